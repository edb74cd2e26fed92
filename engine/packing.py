"""Sequence packing: a right-padded ``[b, L]`` micro-batch as one ``[1, N]`` row without padding.

Position ids restart at 0 for each sequence, which transformers (>= 5) reads, given *no*
attention mask, as sequence boundaries (``masking_utils.find_packed_sequence_indices``). No host
sync: ``N`` comes from the plan, so the flat indices come from ``torch.nonzero_static``.
"""

from __future__ import annotations

import torch

__all__ = ["pack", "packed_index", "unpack"]


def packed_index(valid: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Row-major flat indices ``[N]`` of the ``True`` entries of ``valid [b, L]`` (each
    sequence contiguous, in row order); ``num_tokens`` must equal ``valid.sum()``."""
    if valid.dim() != 2:
        raise ValueError(f"valid must be [b, L], got shape {tuple(valid.shape)}")
    flat = valid.reshape(-1)
    return torch.nonzero_static(flat, size=num_tokens, fill_value=flat.numel()).squeeze(1)


def pack(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[b, L, ...]`` right-padded -> ``[1, N, ...]``: the entries at ``index`` (:func:`packed_index`)."""
    return values.reshape(-1, *values.shape[2:]).index_select(0, index).unsqueeze(0)


def unpack(packed: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack` (differentiable): ``[1, N, ...]`` -> ``[b, L, ...]``, 0 elsewhere."""
    flat = packed.squeeze(0)
    out = flat.new_zeros(valid.numel(), *flat.shape[1:]).index_copy(0, index, flat)
    return out.view(*valid.shape, *flat.shape[1:])
