"""The one interface the trainer drives an out-of-process sampler through (docs/async.md).

A sampler in other processes takes *jobs* (prompts to sample, episodes to play) now and returns
their rollouts later, so the trainer trains in between; a weight push is queued between jobs, so
each job's policy version is known when it is submitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from microrl.engine.rollout.base import Rollout, SamplingParams

__all__ = ["POLICY_VERSION_KEY", "AsyncSampler", "Job", "WorkerError"]

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
