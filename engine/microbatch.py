"""Micro-batch planning and the compact layout (pure functions, no model; docs/engine.md).

**Planning** (:func:`plan_micro_batches`): rows sorted by length, never separating a ``group``.
**Compaction** (:func:`compact_rows` / :func:`scatter_rows`): a *right-padded* ``[b, L]`` block,
``L`` its longest real span, so any padding side runs the same computation. An entry
``[B, T, ...]`` is per-token, any other (and the image keys) per-row (docs/batch.md); outputs go
back the same way, ``[b, L]`` to ``[B, T]``, ``[b]`` to ``[B]``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict, UnbatchedTensor

from microrl.engine.vision import IMAGE_KEYS

__all__ = [
    "MicroBatch",
    "compact_rows",
    "micro_batch_cost",
    "plan_micro_batches",
    "planned_micro_batches",
    "scatter_outputs",
    "scatter_rows",
    "span_starts_and_lengths",
]


@dataclass
class MicroBatch:
    """A planned micro-batch: ``data`` validated, compact, right-padded ``[b, L]``; ``lengths``
    the rows' real-token counts on the host (the forward needs no sync); ``filler`` a stand-in
    run only so every data-parallel rank runs the same forwards (nothing of it counts)."""

    data: TensorDict
    lengths: list[int]
    filler: bool = False


def micro_batch_cost(lengths: Sequence[int], *, packed: bool) -> int:
    """Tokens a micro-batch costs: real tokens when packed, ``rows * longest`` when padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
    packed: bool = False,
    min_micro_batches: int = 1,
    groups: Sequence[int] | None = None,
) -> list[list[int]]:
    """Split row indices into micro-batches.

    Args:
        lengths: real-token count of each row of the mini-batch (``[B]``).
        micro_batch_size: fixed number of rows per micro-batch (exclusive with ``max_tokens``).
        max_tokens: strict budget of :func:`micro_batch_cost` per micro-batch, exceeded only by
            a single row that is longer on its own.
        packed: whether the cost counts real tokens (sequence packing) or padded ``rows * L``.
        min_micro_batches: at least this many (empty ones appended; data parallelism).
        groups: a group id per row, or None: rows with one id land in one micro-batch, so a
            loss comparing them sees all of them (a ``ValueError`` when a group cannot fit).

    Returns:
        Row-index lists, every row exactly once, by length (longest first) and balanced: the
        largest cost is as small as the number of micro-batches allows.
    """
    if (micro_batch_size is None) == (max_tokens is None):
        raise ValueError("set exactly one of micro_batch_size or max_tokens")
    if min_micro_batches < 1:
        raise ValueError(f"min_micro_batches must be >= 1, got {min_micro_batches}")
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    units, ids = _units(lengths, groups)
    # Longest first; ties keep the original order so a plan is deterministic. Without groups
    # every unit is one row, ordered by (-length, row).
    widths = [max(lengths[i] for i in unit) for unit in units]
    order = sorted(range(len(units)), key=lambda u: (-widths[u], units[u][0]))
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        for u in order:
            if len(units[u]) > micro_batch_size:
                raise ValueError(
                    f"group {ids[u]!r} has {len(units[u])} rows, more than "
                    f"micro_batch_size={micro_batch_size}: the rows of a group are never split "
                    "over micro-batches; raise micro_batch_size (e.g. to a multiple of the group "
                    "size) or set a token budget instead"
                )
        plan: list[list[int]] = []
        for u in order:
            if plan and len(plan[-1]) + len(units[u]) <= micro_batch_size:
                plan[-1].extend(units[u])
            else:
                plan.append(list(units[u]))
    elif max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    else:
        for u in order:
            cost = micro_batch_cost([lengths[i] for i in units[u]], packed=packed)
            if len(units[u]) > 1 and cost > max_tokens:
                raise ValueError(
                    f"group {ids[u]!r} ({len(units[u])} rows) costs {cost} tokens "
                    f"({'packed' if packed else 'padded'}), more than the token budget "
                    f"max_tokens_per_micro_batch={max_tokens}: the rows of a group are never "
                    "split over micro-batches; raise the budget"
                )
        planner = _plan_packed if packed else _plan_padded
        plan = planner(order, units, lengths, max_tokens, min_micro_batches)
    plan = [g for g in plan if g]
    while len(plan) < min_micro_batches:
        plan.append([])
    return plan


def _units(
    lengths: list[int], groups: Sequence[int] | None
) -> tuple[list[list[int]], list[object]]:
    """The indivisible units of a plan (one per row, or per group id) and an id for each."""
    if groups is None:
        return [[i] for i in range(len(lengths))], list(range(len(lengths)))
    groups = list(groups)
    if len(groups) != len(lengths):
        raise ValueError(f"groups has {len(groups)} entries for {len(lengths)} rows")
    members: dict[object, list[int]] = {}
    for row, gid in enumerate(groups):
        members.setdefault(gid, []).append(row)
    return list(members.values()), list(members)


def _plan_padded(
    order: list[int], units: list[list[int]], lengths: list[int], budget: int, k_min: int
) -> list[list[int]]:
    """Consecutive runs of the width-sorted units: the fewest runs under ``budget`` (a greedy
    pass), balanced by a binary search for the smallest cap that needs no more runs."""
    if not order:
        return []
    widths = {u: max(lengths[i] for i in units[u]) for u in order}

    def runs(cap: int) -> list[list[int]]:
        out: list[list[int]] = []
        width = 0
        for u in order:
            # Sorted widest first, so the first unit of a run sets its padded width.
            if out and (len(out[-1]) + len(units[u])) * max(width, widths[u]) <= cap:
                out[-1].extend(units[u])
                width = max(width, widths[u])
            else:
                out.append(list(units[u]))
                width = widths[u]
        return out

    target = max(len(runs(budget)), min(k_min, len(order)))
    # The cap only limits adding a unit to a run, so it never exceeds the budget (a longer row
    # still runs alone; the caller checks that a group fits).
    low, high = 1, budget
    while low < high:
        mid = (low + high) // 2
        if len(runs(mid)) <= target:
            high = mid
        else:
            low = mid + 1
    return runs(low)


def _plan_packed(
    order: list[int], units: list[list[int]], lengths: list[int], budget: int, k_min: int
) -> list[list[int]]:
    """Longest-processing-time bin packing: each unit to the least-loaded of ``k`` bins, ``k``
    from ``ceil(total / budget)`` up until every bin fits (LPT: within 4/3 of the optimum)."""
    loads_of = {u: sum(lengths[i] for i in units[u]) for u in order}
    order = sorted(order, key=lambda u: (-loads_of[u], units[u][0]))  # LPT: largest load first
    # A row over the budget runs alone; the others are packed around it.
    alone = [list(units[u]) for u in order if loads_of[u] > budget]
    rest = [u for u in order if loads_of[u] <= budget]
    if not rest:
        return alone
    k = max(-(-sum(loads_of[u] for u in rest) // budget), min(k_min - len(alone), len(rest)), 1)
    while True:
        bins: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for u in rest:
            j = min(range(k), key=lambda b: (loads[b], b))
            bins[j].extend(units[u])
            loads[j] += loads_of[u]
        if all(load <= budget for load in loads):
            return alone + bins
        k += 1


def planned_micro_batches(
    batch: TensorDict,
    plan: list[list[int]],
    spans: tuple[torch.Tensor, torch.Tensor],
    host_lengths: Sequence[int],
    *,
    filler_count_key: str | None,
    placeholder: bool = False,
) -> Iterator[tuple[list[int], MicroBatch]]:
    """The compact micro-batches of ``plan``, with their rows (``spans``: the rows' starts and
    lengths). An empty entry, or any of a ``placeholder`` share, is a filler of row 0 that keeps
    the collective count equal across ranks; its ``filler_count_key`` (if any) is zeroed."""
    starts, lengths = spans
    for rows in plan:
        filler = not rows or placeholder
        rows = [0] if filler else rows
        data = compact_rows(batch, rows, starts, lengths, max(host_lengths[r] for r in rows))
        if filler and filler_count_key is not None:
            data[filler_count_key] = torch.zeros_like(data[filler_count_key])
        yield rows, MicroBatch(data, [host_lengths[r] for r in rows], filler=filler)


def span_starts_and_lengths(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First real column and real-token count of each row of a contiguous ``[B, T]`` mask."""
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(dim=1)
    starts = torch.where(lengths > 0, mask.to(torch.int8).argmax(dim=1), torch.zeros_like(lengths))
    return starts, lengths


def compact_rows(
    batch: TensorDict,
    rows: Sequence[int],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
) -> TensorDict:
    """Gather ``rows`` of ``batch`` into a right-padded ``[b, width]`` micro-batch.

    Column ``j`` of a ``[B, T]`` entry is column ``starts[row] + j`` of the input (0 / False past
    the row's length); per-row entries are indexed by row, the pixel store kept whole.
    """
    device = batch.device if batch.device is not None else batch["input_ids"].device
    index = torch.as_tensor(list(rows), dtype=torch.long, device=device)
    num_cols = batch["input_ids"].shape[1]
    cols = torch.arange(width, device=device)
    span = lengths.index_select(0, index).unsqueeze(1)
    valid = cols.unsqueeze(0) < span
    gather_cols = (starts.index_select(0, index).unsqueeze(1) + cols).clamp(max=num_cols - 1)
    out = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids"):
            continue
        if isinstance(value, UnbatchedTensor):  # not per row (the pixel store): kept whole
            out[key] = value
            continue
        picked = value.index_select(0, index)
        if picked.dim() >= 2 and picked.shape[1] == num_cols and key not in IMAGE_KEYS:
            idx = gather_cols.reshape(*gather_cols.shape, *([1] * (picked.dim() - 2)))
            picked = picked.gather(1, idx.expand(-1, -1, *picked.shape[2:]))
            keep = valid.reshape(*valid.shape, *([1] * (picked.dim() - 2)))
            picked = torch.where(keep, picked, torch.zeros((), dtype=picked.dtype, device=device))
        out[key] = picked
    out["attention_mask"] = valid
    out["position_ids"] = torch.where(valid, cols.unsqueeze(0), 0).expand(len(index), -1)
    return TensorDict(out, batch_size=[len(index)], device=batch.device)


def scatter_rows(
    compact: torch.Tensor,
    rows: Sequence[int],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Inverse of :func:`compact_rows` for one ``[b, width]`` output: each row's real span is
    written into ``out [B, T]``, the rest keeps its zeros."""
    if not len(rows):
        return
    device = out.device
    index = torch.as_tensor(list(rows), dtype=torch.long, device=device)
    num_cols = out.shape[1]
    cols = torch.arange(compact.shape[1], device=device)
    valid = cols.unsqueeze(0) < lengths.index_select(0, index).unsqueeze(1)
    # Padding columns go to one scratch column, dropped after: no two writes hit one place.
    target_cols = torch.where(valid, starts.index_select(0, index).unsqueeze(1) + cols, num_cols)
    block = torch.cat([out.index_select(0, index), out.new_zeros(len(index), 1)], dim=1)
    block.scatter_(1, target_cols, compact.to(out.dtype))
    out.index_copy_(0, index, block[:, :num_cols])


def scatter_outputs(
    output: TensorDict,
    rows: Sequence[int],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    into: dict[str, torch.Tensor],
    shape: tuple[int, int],
) -> None:
    """Write a micro-batch's outputs into fp32 buffers of the mini-batch (created on first use in
    ``into``): :func:`scatter_rows` for each ``[b, L]`` output (into ``[B, T]``), a row copy for
    each per-row ``[b]`` output (into ``[B]``, row ``rows[i]`` gets entry ``i``)."""
    for key, value in output.items():
        per_row = value.dim() == 1
        if key not in into:
            size = shape[:1] if per_row else shape
            into[key] = torch.zeros(size, dtype=torch.float32, device=value.device)
        if per_row:
            if len(rows):
                index = torch.as_tensor(list(rows), dtype=torch.long, device=value.device)
                into[key].index_copy_(0, index, value.to(torch.float32))
        else:
            scatter_rows(value, rows, starts, lengths, into[key])
