"""The batch layout of images (docs/batch.md#images): its keys, the shared pixel store, and
:func:`pad_images`, which lays processor outputs out for the trainer and every sampler.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, UnbatchedTensor

__all__ = [
    "IMAGE_GRID_KEY",
    "IMAGE_INDEX_KEY",
    "IMAGE_KEYS",
    "PIXEL_VALUES_KEY",
    "from_plain_tensors",
    "image_store",
    "kept_images",
    "pad_images",
    "to_plain_tensors",
]

PIXEL_VALUES_KEY = "pixel_values"
IMAGE_GRID_KEY = "image_grid_thw"
IMAGE_INDEX_KEY = "image_index"
#: The image keys: never a token axis (even when a dimension happens to be ``T``).
IMAGE_KEYS = (PIXEL_VALUES_KEY, IMAGE_GRID_KEY, IMAGE_INDEX_KEY)


def image_store(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(store [G, P, D], index [B])`` of a batch with images, in either layout (per-row
    ``pixel_values``: ``index`` is ``arange(B)``); the store as a plain tensor."""
    store = _plain(batch[PIXEL_VALUES_KEY])
    if IMAGE_INDEX_KEY in batch:
        return store, batch[IMAGE_INDEX_KEY]
    return store, torch.arange(batch.batch_size[0], device=store.device)


def _plain(value: torch.Tensor) -> torch.Tensor:
    return value.as_subclass(torch.Tensor) if isinstance(value, UnbatchedTensor) else value


def to_plain_tensors(batch: TensorDict) -> dict[str, torch.Tensor]:
    """``batch``'s entries as plain tensors, as ``torch.load(weights_only=True)`` reads them."""
    return {key: _plain(value) for key, value in batch.items()}


def from_plain_tensors(tensors: dict[str, torch.Tensor], rows: int) -> TensorDict:
    """The ``TensorDict [rows]`` of :func:`to_plain_tensors`' entries, the store wrapped again."""
    tensors = dict(tensors)
    if IMAGE_INDEX_KEY in tensors and PIXEL_VALUES_KEY in tensors:
        tensors[PIXEL_VALUES_KEY] = UnbatchedTensor(_plain(tensors[PIXEL_VALUES_KEY]))
    return TensorDict(tensors, batch_size=[rows])


def kept_images(batch: TensorDict) -> TensorDict:
    """``batch`` (rows selected from a bigger one) with only the store entries its rows use,
    ``image_index`` renumbered, in place; unchanged without a shared store."""
    if IMAGE_INDEX_KEY not in batch or PIXEL_VALUES_KEY not in batch:
        return batch
    store, index = image_store(batch)
    used, renumbered = torch.unique(index[index >= 0], return_inverse=True)
    if len(used) == store.shape[0]:
        return batch
    new_index = torch.full_like(index, -1)
    new_index[index >= 0] = renumbered
    batch[PIXEL_VALUES_KEY] = UnbatchedTensor(store[used])
    batch[IMAGE_INDEX_KEY] = new_index
    return batch


def pad_images(
    rows: list[tuple[torch.Tensor, torch.Tensor] | None],
) -> dict[str, torch.Tensor]:
    """Per-row processor outputs -> the batch's image keys: ``rows[b]`` is ``(pixel_values [p_b, D],
    image_grid_thw [n_b, 3])`` or None; rows holding the same ``pixel_values`` tensor share a store
    entry. Returns ``pixel_values`` (``UnbatchedTensor [G, P, D]``), ``image_index`` ``[B]`` (-1:
    none), ``image_grid_thw`` ``[B, I, 3]``, zero-padded; ``ValueError`` when no row has images or
    a row's patch count does not match its grids."""
    present = [r for r in rows if r is not None]
    if not present:
        raise ValueError("pad_images needs at least one row with images")
    dim, like = present[0][0].shape[-1], present[0][0]
    entries: dict[int, int] = {}  # id of a row's pixel tensor -> its entry
    stored: list[torch.Tensor] = []
    index = torch.full((len(rows),), -1, dtype=torch.long, device=like.device)
    count = max(g.shape[0] for _, g in present)
    grids = torch.zeros(len(rows), count, 3, dtype=torch.long, device=like.device)
    for b, row in enumerate(rows):
        if row is None:
            continue
        p, g = row
        if p.dim() != 2 or p.shape[1] != dim or g.dim() != 2 or g.shape[1] != 3:
            raise ValueError(
                f"row {b}: pixel_values must be [p, {dim}] and image_grid_thw [n, 3], got "
                f"{tuple(p.shape)} and {tuple(g.shape)}"
            )
        if int(g.prod(-1).sum()) != p.shape[0]:
            raise ValueError(
                f"row {b}: image_grid_thw {g.tolist()} gives {int(g.prod(-1).sum())} patches, "
                f"pixel_values holds {p.shape[0]}"
            )
        if id(p) not in entries:
            entries[id(p)] = len(stored)
            stored.append(p)
        index[b] = entries[id(p)]
        grids[b, : g.shape[0]] = g
    width = max(p.shape[0] for p in stored)
    pixels = like.new_zeros(len(stored), width, dim)
    for entry, p in enumerate(stored):
        pixels[entry, : p.shape[0]] = p
    return {
        PIXEL_VALUES_KEY: UnbatchedTensor(pixels),
        IMAGE_INDEX_KEY: index,
        IMAGE_GRID_KEY: grids,
    }
