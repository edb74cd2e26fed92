"""The one interface the trainer drives an out-of-process sampler through (docs/async.md).

A sampler in other processes takes *jobs* (prompts to sample, episodes to play) now and returns
their rollouts later, so the trainer trains in between; a weight push is queued between jobs, so
each job's policy version is known when it is submitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from microrl.engine.rollout.base import Rollout, SamplingParams

__all__ = ["POLICY_VERSION_KEY", "AsyncSampler", "AsyncSamplerBase", "Job", "WorkerError"]

#: The per-row ``[B]`` int64 batch key holding the policy version a row was sampled with.
POLICY_VERSION_KEY = "policy_version"


class WorkerError(RuntimeError):
    """A sampler process failed, died, or did not answer in time."""


@dataclass(frozen=True)
class Job:
    """A submitted job: its id and the policy version it samples."""

    id: int
    version: int
    kind: str


@runtime_checkable
class AsyncSampler(Protocol):
    """Samples in other processes: submit jobs now, collect their rollouts later.

    ``version`` is the policy version the next job samples (one more per :meth:`sync`);
    ``sync_stats[version]`` holds each verified push's probe statistics
    (:func:`~microrl.engine.rollout.sync_check.probe_stats`).
    """

    version: int
    sync_stats: dict[int, dict[str, float]]

    def submit(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams
    ) -> Job:
        """Queue sampling ``params.num_samples`` responses per prompt."""
        ...

    def submit_episodes(
        self,
        problems: Sequence[Any],
        params: SamplingParams,
        *,
        max_turns: int,
        max_tokens: int,
        skip_env_errors: bool = False,
    ) -> Job:
        """Queue the multi-turn episodes of ``problems`` (the sampler's ``env_maker``)."""
        ...

    def collect(self, job: Job) -> Rollout:
        """The rollout of ``job``, waiting for it; its batch carries ``policy_version``."""
        ...

    def poll(self) -> None:
        """Raise what has failed so far (a push's check, a worker) without waiting."""
        ...

    def sync(self, engine: Any = None) -> None:
        """Push the engine's weights as version ``version + 1``; jobs from now on sample them."""
        ...

    def close(self) -> None:
        """Stop the sampler's processes; idempotent."""
        ...


class AsyncSamplerBase:
    """What every :class:`AsyncSampler` shares: the checks of an episode job's arguments,
    :meth:`generate` and the context manager. A sampler implements :meth:`submit`,
    :meth:`_submit_episodes`, :meth:`collect`, :meth:`poll`, :meth:`sync` and :meth:`close`."""

    #: For multi-turn tasks, ``problem -> environment``; :meth:`submit_episodes` needs it.
    env_maker: Callable[[Any], Any] | None = None

    def submit_episodes(
        self,
        problems: Sequence[Any],
        params: SamplingParams,
        *,
        max_turns: int,
        max_tokens: int,
        skip_env_errors: bool = False,
        seed: int | None = None,
    ) -> Job:
        """Queue the multi-turn episodes of ``problems`` (each row's environment
        ``env_maker(problem)``); ``seed``: the job's seed (None: drawn from ``params``)."""
        if self.env_maker is None:
            raise ValueError(f"submit_episodes needs the env_maker given to {type(self).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        problems = list(problems)
        if not problems:
            raise ValueError("problems must be a non-empty list")
        limits = dict(max_turns=max_turns, max_tokens=max_tokens, skip_env_errors=skip_env_errors)
        return self._submit_episodes(problems, params, limits, seed)

    def _submit_episodes(
        self, problems: list, params: SamplingParams, limits: dict[str, Any], seed: int | None
    ) -> Job:
        raise NotImplementedError

    def collect(self, job: Job) -> Rollout:
        raise NotImplementedError

    def submit(self, prompts: Sequence[Any], params: SamplingParams) -> Job:
        raise NotImplementedError

    def generate(self, prompts: Sequence[Any], params: SamplingParams) -> Rollout:
        """Sample now, at the latest pushed version (:meth:`submit`, then :meth:`collect`)."""
        return self.collect(self.submit(prompts, params))

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
