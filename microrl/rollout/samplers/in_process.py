"""A rollout backend of this process as a :class:`~microrl.rollout.sampler.Sampler`: a job samples
when collected, on the trainer's thread, with the weights synced last (staleness 0)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from microrl.rollout.base import Images, Prompts, Rollout, RolloutBackend, SamplingParams
from microrl.rollout.images import problem_images
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, Sampler

__all__ = ["InProcessSampler"]


class InProcessSampler(Sampler):
    """Samples ``backend`` at :meth:`collect` (see the module docstring).

    Args:
        backend: ``HFRollout`` (the live model) or ``VLLMRollout`` (a copy of the weights).
        engine: the engine whose weights a sync loads.
        version: the policy version of the engine's weights now (the recipe: its step).
        sync_every: a backend holding a copy loads every ``sync_every``-th version only
            (``rollout.sync_every``); :meth:`current` loads them at once.
        env_maker: for multi-turn tasks, ``problem -> environment``.
    """

    # It samples here, when a job is collected: collectively under torchrun, every rank in step.
    trainer_thread = samples_at_collect = True

    def __init__(
        self,
        backend: RolloutBackend,
        engine: Any,
        *,
        version: int = 0,
        sync_every: int = 1,
        env_maker: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(backend, RolloutBackend):
            raise TypeError(f"backend must be a RolloutBackend, got {type(backend).__name__}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (rollout.sync_every) must be >= 1, got {sync_every!r}")
        self.backend, self.engine, self.env_maker = backend, engine, env_maker
        self.tokenizer, self.image_encoder = backend.tokenizer, backend.image_encoder
        self.stop_token_ids = backend.stop_token_ids
        #: The trainer's version (one more per sync) and the one the backend samples.
        self.version = self.loaded = int(version)
        self.sync_every = sync_every
        self.sync_stats: dict[int, dict[str, float]] = {}  # the backend checks its own loads
        self._jobs: dict[int, Callable[[], Rollout]] = {}
        self._ids = itertools.count()

    @property
    def max_lag(self) -> int:
        """The most versions a row is behind the trainer (0 for the live model)."""
        return self.sync_every - 1 if self.backend.holds_weights else 0

    def submit(self, prompts: Prompts, params: SamplingParams, *, images: Images = None) -> Job:
        prompts = list(prompts)
        return self._queue(
            "generate", lambda: self.backend.generate(prompts, params, images=images)
        )

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        """``seed``: unused, the backend draws from torch's generator as it samples."""
        prompts, images = [p.prompt for p in problems], problem_images(problems)

        def play() -> Rollout:
            make_env = lambda i: self.env_maker(problems[i])  # noqa: E731 - one per row
            return self.backend.run_episodes(prompts, make_env, params, images=images, **limits)

        return self._queue("episodes", play)

    def _queue(self, kind: str, sample: Callable[[], Rollout]) -> Job:
        job = Job(next(self._ids), self.version, kind)
        self._jobs[job.id] = sample
        return job

    def collect(self, job: Job) -> Rollout:
        """Sampled now at version :attr:`loaded`; collective under ``torchrun``."""
        rollout = self._jobs.pop(job.id)()
        rows = len(rollout.texts)
        rollout.batch[POLICY_VERSION_KEY] = torch.full((rows,), self.loaded, dtype=torch.long)
        return rollout

    def current(self) -> RolloutBackend:
        """The backend with the engine's current weights (loaded now when they are not)."""
        if self.loaded != self.version:
            self.backend.sync(self.engine)
            self.loaded = self.version
        return self.backend

    def sync(self, engine: Any = None) -> None:
        """A new version of the engine's weights, loaded now or (a copy) every ``sync_every``."""
        self.engine = engine if engine is not None else self.engine
        self.version += 1
        if not self.backend.holds_weights or self.version % self.sync_every == 0:
            self.current()

    def poll(self) -> None:
        pass  # nothing runs between calls: a failed load raises where it samples

    def close(self) -> None:
        self._jobs.clear()
        self.backend.close()
