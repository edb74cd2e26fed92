"""Wall time and peak GPU memory per phase of an RL step, for benchmarks/bench_gpu_step.py: the
clock, and the hooks that time TRL's ``GRPOTrainer`` (instance attributes wrapped, TRL 1.16's
method names; its class is not touched) by the same phases as microrl's step.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any

import torch

PHASES = ("generation", "old_logprobs", "update")
MiB = 2**20


class PhaseClock:
    """Wall time and peak device memory per phase of each step.

    CUDA is synchronised at every boundary (kernels run asynchronously) and its peak-memory
    counter reset at each phase's start, so a phase's peak is the most allocated within it.
    Phases may not nest; a phase entered twice in one step adds up."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: list[dict[str, float]] = []  # per step: phase -> s, and "step"
        self.peaks: list[dict[str, int]] = []  # per step: phase -> bytes (CUDA)
        self._started: dict[str, float] = {}
        self._step_start = 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin_step(self) -> None:
        self.seconds.append({})
        self.peaks.append({})
        self._step_start = self._now()

    def end_step(self) -> None:
        self.seconds[-1]["step"] = self._now() - self._step_start

    def start(self, name: str) -> None:
        self._started[name] = self._now()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def stop(self, name: str) -> None:
        elapsed = self._now() - self._started.pop(name)
        self.seconds[-1][name] = self.seconds[-1].get(name, 0.0) + elapsed
        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
            self.peaks[-1][name] = max(self.peaks[-1].get(name, 0), peak)

    @contextmanager
    def phase(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def summary(self, warmup: int = 1) -> dict[str, Any]:
        """The median seconds and the largest peak (MiB; None on a CPU) of each phase over the
        steps after the first ``warmup``."""
        timed, peaks = self.seconds[warmup:], self.peaks[warmup:]
        if not timed:
            raise RuntimeError("no timed step")
        out: dict[str, Any] = {}
        for name in (*PHASES, "step"):
            values = [s.get(name, 0.0) for s in timed]
            peak = max((p.get(name, 0) for p in peaks), default=0)
            out[name] = {
                "s": statistics.median(values),
                "peak_mib": peak / MiB if self.cuda else None,
            }
        return out


def time_trl_phases(trainer: Any, clock: PhaseClock) -> None:
    """Generation: ``_generate_single_turn``; old log-probs: a no-grad
    ``_get_per_token_logps_and_entropies``; update: from the end of
    ``_generate_and_score_completions`` to the rollout's last optimizer step."""
    generate = trainer._generate_single_turn
    logps = trainer._get_per_token_logps_and_entropies
    score = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **k: Any) -> Any:
        with clock.phase("generation"):
            return generate(*a, **k)

    def timed_logps(*a: Any, **k: Any) -> Any:
        if torch.is_grad_enabled():  # a training forward: inside the update phase
            return logps(*a, **k)
        with clock.phase("old_logprobs"):
            return logps(*a, **k)

    def timed_score(*a: Any, **k: Any) -> Any:
        out = score(*a, **k)
        clock.start("update")
        return out

    trainer._generate_single_turn = timed_generate
    trainer._get_per_token_logps_and_entropies = timed_logps
    trainer._generate_and_score_completions = timed_score


def rollout_boundaries(clock: PhaseClock, updates: int) -> Any:
    """A callback that ends a step (and its update phase) at each rollout's last optimizer step."""
    from transformers import TrainerCallback

    class Boundaries(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock.begin_step()

        def on_step_end(self, args: Any, state: Any, control: Any, **k: Any) -> None:
            if state.global_step % updates == 0:
                clock.stop("update")
                clock.end_step()
                if state.global_step < state.max_steps:
                    clock.begin_step()

    return Boundaries()
