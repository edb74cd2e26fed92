"""Agent episodes as a sampler's jobs, for every ``rollout.max_staleness`` (docs/rollouts.md#agents).

:class:`AgentSampler` is a :class:`~microrl.rollout.Sampler` composed over the run's sampler.
Over one in this process (:class:`~microrl.rollout.InProcessSampler`) a job's episodes are played
when it is collected, on the trainer's thread, sampling through the backend in batched calls
(collective under ``torchrun``, as :func:`~microrl.agents.runner.run_agent_episodes`). Over one in other processes (the
``hf`` workers, vLLM servers) a job runs on a thread of the trainer process (the endpoint and the
agents with it, :func:`play_agents`) and its calls become jobs of that sampler, so each sampled
token carries the policy version that drew it. A row's ``policy_version`` is its oldest token's:
the staleness the rollout source bounds. One lock orders the sampler's use between that thread
and the trainer (pushes, polls).
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from microrl.agents.runner import AgentLimits, play_agents
from microrl.agents.sampler import BatchingSampler
from microrl.rollout.base import Rollout, SamplingParams
from microrl.rollout.sampler import Job, Sampler
from microrl.rollout.samplers.in_process import InProcessSampler

__all__ = ["AgentSampler"]

_KIND = "agents"


class AgentSampler(Sampler):
    """Plays ``task``'s agent on ``inner``'s jobs (see the module docstring).

    Args:
        inner: the run's sampler (in this process, or holding the pushed weights).
        tokenizer: the policy's.
        task: an agent task (:class:`~microrl.tasks.AgentTask`: its ``agent``, ``reward`` and
            ``tool_parser``).
        limits: the episodes' bounds; each job's token budget and ``skip_errors`` are its own.
        stop_ids: the ids that end a turn, the workers' ``stop_token_ids`` (None: the
            tokenizer's turn terminators; the model's ``generation_config`` adds its own).
    """

    needs_env_maker = False  # the task's agent plays the episodes

    def __init__(
        self,
        inner: Any,
        tokenizer: Any,
        task: Any,
        limits: AgentLimits,
        *,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        self.inner = inner
        self.stop_ids = stop_ids
        self.tokenizer = tokenizer
        self.task = task
        self.limits = limits
        self.lock = threading.RLock()
        # Jobs of episodes run one after the other, in submission (version) order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="microrl-agents")
        self._jobs: dict[int, Future | Callable[[], Rollout]] = {}
        self._ids = itertools.count()
        #: Episodes are played at ``collect`` on the caller's thread: ``inner`` samples there.
        self.at_collect = isinstance(inner, InProcessSampler)

    @property
    def trainer_thread(self) -> bool:
        return self.inner.trainer_thread

    @property
    def samples_at_collect(self) -> bool:
        return self.at_collect

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def sync_stats(self) -> dict[int, dict[str, float]]:
        return self.inner.sync_stats

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        """``params.num_samples`` agent episodes per problem (``max_turns`` does not apply: an
        agent decides its calls; ``max_tokens`` bounds each row; ``seed``: unused)."""
        limits = replace(
            self.limits, max_tokens=limits["max_tokens"], skip_errors=limits["skip_env_errors"]
        )
        job = Job(next(self._ids), self.inner.version, _KIND)
        play = functools.partial(self._play, problems, params, limits)
        self._jobs[job.id] = play if self.at_collect else self._executor.submit(play)
        return job

    def _play(self, problems: list, params: SamplingParams, limits: AgentLimits) -> Rollout:
        if self.at_collect:  # the backend's batched calls, on this thread, the loaded weights
            sampler = BatchingSampler.over_backend(
                self.inner.current(),
                params,
                version=self.inner.loaded,
                window_s=limits.batch_window_s,
            )
        else:  # the inner sampler's jobs, from this job's thread
            sampler = BatchingSampler.over_async(
                self.inner,
                self.tokenizer,
                params,
                self.lock,
                window_s=limits.batch_window_s,
                stop_ids=self.stop_ids,
            )
        task = self.task
        return play_agents(
            sampler,
            problems,
            task.agent,
            params,
            limits,
            reward=task.reward,
            tool_parser=task.tool_parser,
        )

    def submit(self, prompts: Sequence[Any], params: SamplingParams, **kwargs: Any) -> Job:
        with self.lock:
            return self.inner.submit(prompts, params, **kwargs)

    def collect(self, job: Job) -> Rollout:
        """The rollout of ``job`` (waiting for it); rows carry ``policy_version``."""
        if job.kind != _KIND:
            with self.lock:
                return self.inner.collect(job)
        played = self._jobs.pop(job.id)
        return played() if callable(played) else played.result()

    def poll(self) -> None:
        with self.lock:
            self.inner.poll()
        for future in self._jobs.values():  # a failed job surfaces now
            if isinstance(future, Future) and future.done() and future.exception() is not None:
                raise future.exception()

    def sync(self, engine: Any = None) -> None:
        with self.lock:
            self.inner.sync(engine)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.inner.close()
