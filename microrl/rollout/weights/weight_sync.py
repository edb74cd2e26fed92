"""One interface for every way trained weights reach a sampler (docs/async.md#weight-syncs),
and the check every push gets (:class:`ProbeVerifier`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from microrl.rollout.weights.sync_check import (
    SYNC_CHECK_STAT,
    SyncCheckError,
    engine_probe_logprobs,
    probe_rows,
    probe_stats,
    rows_to_probe_layout,
)

__all__ = ["ProbeVerifier", "WeightSync", "pushed_weights"]


class WeightSync(ABC):
    """How one sampler's copy of the weights follows the engine's."""

    @abstractmethod
    def push(self, engine: Any, version: int) -> Future | None:
        """Send ``engine``'s weights as ``version`` (collective); returns once they are read
        (the optimizer may step): None, or a still-running load's Future."""

    def close(self) -> None:
        """Release what the path holds (transfer groups, loaded adapters); idempotent."""
        return None


def pushed_weights(is_lora: bool) -> str:
    """What a failed check names as pushed: the adapter of a LoRA engine, else the full weights."""
    return "the LoRA adapter" if is_lora else "the full weights"


@dataclass
class ProbeVerifier:
    """The check of a sampler's pushes: its ``probe``, ``tol`` and per-version ``stats``."""

    probe: TensorDict
    tol: float
    stats: dict[int, dict[str, float]]

    @classmethod
    def of(cls, sampler: Any) -> ProbeVerifier:
        """The verifier over a sampler's ``probe``, ``sync_check_tol`` and ``sync_stats``."""
        return cls(sampler.probe, sampler.sync_check_tol, sampler.sync_stats)

    def expected(self, engine) -> torch.Tensor:
        """The engine's probe log-probs at temperature 1, ``[B, T]`` float32 on the CPU."""
        return engine_probe_logprobs(engine, self.probe)

    def rows(self) -> list[list[int]]:
        """The probe's rows without their padding: what a sampler scores."""
        return probe_rows(self.probe)

    def layout(self, row_logprobs: list[list[float]]) -> torch.Tensor:
        """A sampler's per-row log-probs (each row's tokens after its first) as ``[B, T]``."""
        return rows_to_probe_layout(self.probe, row_logprobs)

    def verify(
        self,
        version: int,
        target: str,
        expected: torch.Tensor,
        actual: torch.Tensor,
        detail: str,
        *,
        failed: bool = False,
    ) -> dict[str, float]:
        """Compare ``target``'s probe log-probs ``actual`` with ``expected`` (both ``[B, T]``);
        ``SyncCheckError`` over the tolerance or when ``failed``."""
        stats = probe_stats(expected, actual, self.probe["loss_mask"].cpu())
        previous = self.stats.get(version, {})
        self.stats[version] = {k: max(v, previous.get(k, v)) for k, v in stats.items()}
        if failed or not stats[SYNC_CHECK_STAT] <= self.tol:  # NaN fails too
            raise SyncCheckError(
                f"the weight sync of policy version {version} (the weights after step {version}) "
                f"to {target} failed its check: probe log-probs differ by "
                f"{stats[SYNC_CHECK_STAT]:.3g} on average ({SYNC_CHECK_STAT}, the mean "
                f"|difference| over the probe's tokens; tolerance {self.tol:g}, "
                f"rollout.sync_check_tol; at most {stats['sync/probe_abs_diff_max']:.3g}, k3 KL "
                f"{stats['sync/probe_kl']:.3g}); {detail}"
            )
        return stats
