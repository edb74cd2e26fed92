"""How the weights reach ``hf`` worker processes: over each worker's gloo group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from microrl.rollout.weights.weight_sync import WeightSync

__all__ = ["GlooBroadcast"]


class GlooBroadcast(WeightSync):
    """Path 1: the trainable tensors gathered once and broadcast to each ``hf`` worker, which
    answers its probe log-probs and checksums (checked by ``AsyncRollout.poll``)."""

    def __init__(self, workers: Sequence[Any]) -> None:
        self.workers = workers  # the pool's list, filled as its workers start

    def push(self, engine, version: int) -> None:
        first = self.workers[0]
        state = first.pack(engine)  # once: one host copy of the trainable tensors for all
        expected = first.expected_of(engine, state)  # the same probe in every worker
        for worker in self.workers:
            worker.push_version(engine, state, version, expected)
