"""Scoring in the producer: a rollout sampled ahead is scored (a teacher's log-probs) on a
background thread as soon as the sampler returns it, while the trainer trains
(docs/recipes.md#asynchronous-distillation).

:class:`AheadScorer` serves a :class:`~microrl.run.RolloutPrefetcher`: one thread collects the
next round to be trained from the sampler and scores it; the trainer's ``take`` finds it scored.
Every call into the sampler goes through :class:`LockedSampler`, so the thread and the trainer
never drive it at once. ``last_wait_s``: how long the trainer's last ``take`` waited for the
scoring itself (not for the sampling), the number the profile reports as ``teacher/wait_s``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from microrl.engine.rollout import Rollout

__all__ = ["AheadScorer", "LockedSampler"]


class LockedSampler:
    """``sampler`` with every method call under one lock (attributes read as they are)."""

    def __init__(self, sampler: Any, lock: threading.RLock) -> None:
        self._sampler = sampler
        self._lock = lock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._sampler, name)
        if not callable(value):
            return value

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)

        return locked


class AheadScorer:
    """Scores rounds sampled ahead with ``score(rollout)`` (which adds its keys to the batch).

    Args:
        score: the scorer; it must keep a batch that holds its keys already.
        background: score on a thread (True) or when the trainer collects the round (False:
            a scorer whose work is collective under ``torchrun``, which must run in order on
            the trainer's thread).
    """

    def __init__(self, score: Callable[[Rollout], None], *, background: bool) -> None:
        self.score = score
        self.background = background
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="microrl-score") if background else None
        )
        self._running: dict[int, tuple[Any, Future]] = {}
        self.last_wait_s = 0.0

    def start(self, ahead: Any, collect: Callable[[Any], Rollout]) -> None:
        """Collect and score ``ahead`` on the thread, unless it is running already."""
        if self._pool is not None and id(ahead) not in self._running:
            future = self._pool.submit(self._collect_and_score, ahead, collect)
            self._running[id(ahead)] = (ahead, future)

    def collect(self, ahead: Any, collect: Callable[[Any], Rollout]) -> Rollout:
        """``ahead``'s scored rollout, waiting for the thread if it runs there."""
        entry = self._running.pop(id(ahead), None)
        started = time.perf_counter()
        if entry is None:
            rollout, span = self._collect_and_score(ahead, collect)
        else:
            rollout, span = entry[1].result()
        ended = time.perf_counter()
        # The part of the trainer's wait the scoring took (not the sampling before it).
        self.last_wait_s = max(0.0, min(ended, span[1]) - max(started, span[0]))
        return rollout

    def _collect_and_score(
        self, ahead: Any, collect: Callable[[Any], Rollout]
    ) -> tuple[Rollout, tuple[float, float]]:
        rollout = collect(ahead)
        start = time.perf_counter()
        self.score(rollout)  # idempotent: a round scored before (a checkpoint's) is kept
        return rollout, (start, time.perf_counter())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
