"""Selecting groups of a rollout and merging rollouts into one ``[B, T]`` batch, laid out as
:func:`~microrl.rollout.layout.build_rollout` would have from the same samples (docs/rollouts.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from tensordict import TensorDict, UnbatchedTensor

from microrl.engine.moe.routes import NO_ROUTE, ROUTED_EXPERTS_KEY
from microrl.engine.vision_layout import (
    IMAGE_GRID_KEY,
    IMAGE_INDEX_KEY,
    IMAGE_KEYS,
    PIXEL_VALUES_KEY,
    image_store,
    kept_images,
)
from microrl.rollout.base import Rollout

__all__ = ["merge_rollouts", "select_groups"]

_FILLS = {ROUTED_EXPERTS_KEY: NO_ROUTE}  # a token-aligned key's padding (0 / False: others)
_LAYOUT_FIELDS = ("batch", "texts", "group_ids", "metrics")


def select_groups(rollout: Rollout, groups: Sequence[int] | torch.Tensor) -> Rollout:
    """The rows of ``rollout`` answering ``groups``, in order, the kept ids renumbered
    ``0 .. len(groups) - 1`` ascending (the new group ``i`` is ``sorted(groups)[i]``); the batch
    keeps its width. ``ValueError`` for a group id the rollout does not have.
    """
    wanted = torch.as_tensor(groups, dtype=torch.long).reshape(-1).unique()
    present = torch.isin(wanted, rollout.group_ids)
    if not present.all():
        missing = wanted[~present].tolist()
        raise ValueError(f"groups {missing} are not in the rollout (its ids: 0..)")
    rows = torch.isin(rollout.group_ids, wanted).nonzero().squeeze(1)
    _, group_ids = torch.unique(rollout.group_ids[rows], return_inverse=True)
    extra = {name: value[rows] for name, value in _per_row_fields(rollout).items()}
    return Rollout(
        batch=kept_images(rollout.batch[rows]),  # the dropped groups' pixels freed
        texts=[rollout.texts[i] for i in rows.tolist()],
        group_ids=group_ids.to(torch.long),
        metrics=dict(rollout.metrics),  # what sampling cost (env time, errors) stays spent
        **extra,
    )


def merge_rollouts(rollouts: Sequence[Rollout], *, pad_token_id: int) -> Rollout:
    """One rollout with the rows of ``rollouts``, in order, in one batch as wide as the longest
    prompt plus the longest response: per-token entries move by whole columns, padded with
    ``pad_token_id`` (``input_ids``), -1 (``routed_experts``) or 0; image keys merged;
    ``group_ids`` renumbered part after part; ``metrics`` (sums) added up. ``ValueError`` for no
    part, different batch keys, or a part not in the rollout layout.
    """
    if not rollouts:
        raise ValueError("merge_rollouts needs at least one rollout")
    keys = set(rollouts[0].batch.keys()) - set(IMAGE_KEYS)
    for part in rollouts[1:]:
        if set(part.batch.keys()) - set(IMAGE_KEYS) != keys:
            raise ValueError(
                f"rollouts with different batch keys cannot be merged: {sorted(keys)} and "
                f"{sorted(part.batch.keys())}"
            )
    spans = [_span(part.batch) for part in rollouts]
    prompt_width = max(prompt for _, prompt, _ in spans)
    response_width = max(1, *(response for _, _, response in spans))
    width = prompt_width + response_width
    columns: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    fills = {**_FILLS, "input_ids": pad_token_id}
    for part, (boundary, _, _) in zip(rollouts, spans, strict=True):
        offset = boundary - prompt_width  # the part's column of the merged column 0
        for key in keys:
            value = part.batch[key]
            if value.dim() >= 2 and value.shape[1] == part.batch["input_ids"].shape[1]:
                value = _shift_columns(value, offset, width, fills.get(key, 0))
            columns[key].append(value)
    rows = sum(part.batch.batch_size[0] for part in rollouts)
    batch = TensorDict(
        {key: torch.cat(values) for key, values in columns.items()}, batch_size=[rows]
    )
    if any(PIXEL_VALUES_KEY in part.batch for part in rollouts):
        batch.update(_merged_images([part.batch for part in rollouts]))
    group_ids, first = [], 0
    for part in rollouts:
        _, index = torch.unique(part.group_ids, return_inverse=True)
        group_ids.append(index.to(torch.long) + first)
        first += int(index.max()) + 1 if index.numel() else 0
    per_row = [_per_row_fields(part) for part in rollouts]
    names = sorted(set().union(*per_row))
    for name in names:
        if not all(name in fields for fields in per_row):
            raise ValueError(f"Rollout.{name} is set on some of the rollouts only")
    extra = {name: torch.cat([fields[name] for fields in per_row]) for name in names}
    metrics: dict[str, float] = {}
    for part in rollouts:  # sums (env seconds, errors): they add up over the parts
        for key, value in part.metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    return Rollout(
        batch=batch,
        texts=[text for part in rollouts for text in part.texts],
        group_ids=torch.cat(group_ids),
        metrics=metrics,
        **extra,
    )


def _per_row_fields(rollout: Rollout) -> dict[str, torch.Tensor]:
    """The rollout's optional per-row ``[B]`` fields that are set (``rewards``, ``num_turns``)."""
    fields = {}
    for f in dataclasses.fields(rollout):
        value = getattr(rollout, f.name)
        if f.name in _LAYOUT_FIELDS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 1 and value.shape[0] == len(rollout.texts):
            fields[f.name] = value
    return fields


def _span(batch: TensorDict) -> tuple[int, int, int]:
    """``(boundary, prompt, response)``: the first response column, the longest prompt and response."""
    attention, loss = batch["attention_mask"].bool(), batch["loss_mask"].bool()
    width = attention.shape[1]
    if attention.shape[0] == 0:
        return 0, 0, 0
    cols = torch.arange(width, device=attention.device)
    response_cols = loss.any(dim=0).nonzero()
    if response_cols.numel():
        boundary = int(response_cols[0])
    else:  # no response token at all: every real token is prompt
        boundary = int(torch.where(attention, cols + 1, 0).max())
    if boundary == 0 or not attention[:, boundary - 1].all():
        raise ValueError(
            "a rollout batch must be [left-padded prompt | response, right-padded]: every row's "
            f"prompt must end at column {boundary - 1}, before the first loss_mask column"
        )
    first = torch.where(attention, cols, width).min(dim=1).values
    last = torch.where(attention, cols, -1).max(dim=1).values
    prompt = int((boundary - first).max())
    response = int((last + 1 - boundary).clamp_min(0).max())
    return boundary, prompt, response


def _shift_columns(value: torch.Tensor, offset: int, width: int, fill: int) -> torch.Tensor:
    """``out[:, j] = value[:, offset + j]`` for ``j`` in ``[0, width)``, else ``fill``."""
    out = value.new_full((value.shape[0], width, *value.shape[2:]), fill)
    lo, hi = max(0, offset), min(value.shape[1], offset + width)
    if hi > lo:
        out[:, lo - offset : hi - offset] = value[:, lo:hi]
    return out


def _merged_images(batches: Sequence[TensorDict]) -> dict[str, torch.Tensor]:
    """The parts' image keys as one: pixel stores concatenated (entries zero-padded), each
    ``image_index`` shifted past the parts before (-1 kept), grids zero-padded; a part without
    images gives text rows."""
    parts = [image_store(b) if PIXEL_VALUES_KEY in b else None for b in batches]
    like = next(store for store, _ in filter(None, parts))
    width = max(store.shape[1] for store, _ in filter(None, parts))
    count = max(b[IMAGE_GRID_KEY].shape[1] for b in batches if IMAGE_GRID_KEY in b)
    stores, indices, grids, first = [], [], [], 0
    for batch, part in zip(batches, parts, strict=True):
        rows = batch.batch_size[0]
        if part is None:
            indices.append(torch.full((rows,), -1, dtype=torch.long, device=like.device))
            grids.append(torch.zeros(rows, count, 3, dtype=torch.long, device=like.device))
            continue
        store, index = part
        stores.append(torch.nn.functional.pad(store, (0, 0, 0, width - store.shape[1])))
        indices.append(torch.where(index >= 0, index + first, index))
        grid = batch[IMAGE_GRID_KEY]
        grids.append(torch.nn.functional.pad(grid, (0, 0, 0, count - grid.shape[1])))
        first += store.shape[0]
    return {
        PIXEL_VALUES_KEY: UnbatchedTensor(torch.cat(stores)),
        IMAGE_INDEX_KEY: torch.cat(indices),
        IMAGE_GRID_KEY: torch.cat(grids),
    }
