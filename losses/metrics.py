"""Metrics that aggregate exactly across micro-batches and ranks.

A loss returns ``dict[str, Metric]``. Each :class:`Metric` is a detached 0-d tensor plus how it
combines: ``SUM`` for partial means already divided by the global denominators (so the sum over
micro-batches and ranks *is* the global mean), ``MIN`` / ``MAX`` for extremes. The engine stacks the
micro-batch values on device and converts to Python floats once per mini-batch, with no host sync
inside the micro-batch loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

__all__ = ["Metric", "Reduce", "reduce_metrics"]


class Reduce(str, Enum):
    """How a metric combines over micro-batches and ranks."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"


# The identity of each reduction; a MIN/MAX metric over an empty set (an all-masked micro-batch)
# holds it, so it never wins against a real value. A mini-batch with no value at all reports NaN
# (see reduce_metrics).
_IDENTITY = {Reduce.SUM: 0.0, Reduce.MIN: float("inf"), Reduce.MAX: float("-inf")}


@dataclass(frozen=True)
class Metric:
    """A detached 0-d metric value and its :class:`Reduce` (``SUM`` of partials, ``MIN``, ``MAX``)."""

    value: torch.Tensor
    reduce: Reduce = Reduce.SUM

    @staticmethod
    def empty(reduce: Reduce, device: torch.device | str = "cpu") -> Metric:
        """The reduction's identity (0, +inf or -inf): a metric of an empty micro-batch.

        :func:`reduce_metrics` reports a MIN/MAX metric that is empty everywhere as NaN.
        """
        return Metric(torch.tensor(_IDENTITY[reduce], device=device), reduce)


def reduce_metrics(
    per_micro_batch: Iterable[Mapping[str, Metric]],
    *,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Combine micro-batch metrics (and DP ranks, when torch.distributed is initialised).

    Every rank must pass the same metric names (an empty micro-batch on one rank still reports
    its identities). Returns Python floats.

    A MIN/MAX metric that saw no value anywhere (it still holds its identity, +inf for MIN, -inf
    for MAX: e.g. ``ratio_min`` of a mini-batch without loss tokens) is NaN, "no value": 0 would
    read as a real extreme (a ratio of 0). It stays in the result rather than being dropped, so
    every step reports the same keys (loggers and per-step averages expect that); the examples'
    tracker writes NaN as null and TensorBoard, the progress bar and the plot skip it. A real
    infinite extreme (a MAX of +inf) is kept as is.
    """
    merged: dict[str, list[Metric]] = {}
    for metrics in per_micro_batch:
        for name, metric in metrics.items():
            merged.setdefault(name, []).append(metric)
    if not merged:
        return {}
    names = sorted(merged)
    values, kinds = [], []
    for name in names:
        kind = merged[name][0].reduce
        if any(m.reduce is not kind for m in merged[name]):
            raise ValueError(f"metric {name!r} reported with different reductions")
        stacked = torch.stack([m.value.detach().float().reshape(()) for m in merged[name]])
        values.append(_reduce_local(stacked, kind))
        kinds.append(kind)
    result = torch.stack(values).to(torch.float64)
    if dist.is_available() and dist.is_initialized():
        for kind, op in (
            (Reduce.SUM, dist.ReduceOp.SUM),
            (Reduce.MIN, dist.ReduceOp.MIN),
            (Reduce.MAX, dist.ReduceOp.MAX),
        ):
            idx = [i for i, k in enumerate(kinds) if k is kind]
            if idx:
                part = result[idx].clone()
                dist.all_reduce(part, op=op, group=group)
                result[idx] = part
    out = {}
    for name, kind, value in zip(names, kinds, result.tolist(), strict=True):
        empty = kind is not Reduce.SUM and value == _IDENTITY[kind]
        out[name] = math.nan if empty else value
    return out


def _reduce_local(stacked: torch.Tensor, kind: Reduce) -> torch.Tensor:
    if kind is Reduce.SUM:
        return stacked.sum()
    return stacked.min() if kind is Reduce.MIN else stacked.max()
