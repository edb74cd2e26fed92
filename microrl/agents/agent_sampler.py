"""Agent episodes as a sampler's jobs, for every ``rollout.max_staleness`` (docs/rollouts.md#agents).

Over a sampler in this process a job's episodes are played at ``collect``, on the trainer's
thread; over one in other processes a job runs on a trainer-process thread whose calls become
that sampler's jobs (a row's ``policy_version``: its oldest token's), one lock ordering them.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from microrl.agents.runner import AgentLimits, play_agents, run_agent_episodes
from microrl.agents.sampler import BatchingSampler
from microrl.rollout.base import Rollout, SamplingParams
from microrl.rollout.sampler import Job, Sampler
from microrl.rollout.samplers.in_process import InProcessSampler

__all__ = ["AgentSampler"]

_KIND = "agents"


class AgentSampler(Sampler):
    """Plays ``task``'s agent (an :class:`~microrl.tasks.AgentTask`) on ``inner``'s jobs.

    ``limits``: the episodes' bounds (each job's token budget and ``skip_errors`` its own);
    ``stop_ids``: the workers' ``stop_token_ids`` (None: the tokenizer's turn terminators).
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
        self.inner, self.tokenizer, self.task = inner, tokenizer, task
        self.limits, self.stop_ids = limits, stop_ids
        self.lock = threading.RLock()
        # Episode jobs run one after the other, in submission (version) order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="microrl-agents")
        self._jobs: dict[int, Future | Callable[[], Rollout]] = {}
        self._ids = itertools.count()
        self.trainer_thread = inner.trainer_thread
        self.samples_at_collect = isinstance(inner, InProcessSampler)

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def sync_stats(self) -> dict[int, dict[str, float]]:
        return self.inner.sync_stats

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        """``params.num_samples`` agent episodes per problem (``max_turns`` and ``seed`` unused)."""
        limits = replace(
            self.limits, max_tokens=limits["max_tokens"], skip_errors=limits["skip_env_errors"]
        )
        job = Job(next(self._ids), self.inner.version, _KIND)
        play = functools.partial(self._play, problems, params, limits)
        self._jobs[job.id] = play if self.samples_at_collect else self._executor.submit(play)
        return job

    def _play(self, problems: list, params: SamplingParams, limits: AgentLimits) -> Rollout:
        task = self.task
        scoring = {"reward": task.reward, "tool_parser": task.tool_parser}
        if self.samples_at_collect:  # the backend's batched calls, on this thread, loaded weights
            backend, version = self.inner.current(), self.inner.loaded
            return run_agent_episodes(
                backend, problems, task.agent, params, limits, version=version, **scoring
            )
        sampler = BatchingSampler.over_async(  # the inner sampler's jobs, from this job's thread
            self.inner,
            self.tokenizer,
            params,
            self.lock,
            window_s=limits.batch_window_s,
            stop_ids=self.stop_ids,
        )
        return play_agents(sampler, problems, task.agent, params, limits, **scoring)

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
