"""Sequence packing: a right-padded ``[b, L]`` micro-batch as one ``[1, N]`` row without padding.

The real tokens of every row are concatenated; position ids restart at 0 for each sequence.
transformers (>= 5) recognises this layout when it gets ``position_ids`` and *no* attention mask
(``masking_utils.find_packed_sequence_indices``: a position that does not follow its predecessor
by +1 starts a new sequence) and builds a block-diagonal causal mask for the eager/SDPA/flex
kernels, or passes sequence boundaries to flash-attention. So each token attends exactly to the
tokens of its own sequence, as in the padded layout, and the ``b * L - N`` padding tokens cost
nothing.
"""

from __future__ import annotations

import torch

__all__ = ["pack", "unpack"]


def pack(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[b, L, ...]`` right-padded -> ``[1, N, ...]``: the entries where ``valid [b, L]`` holds.

    Row-major order keeps each sequence contiguous and the sequences in row order.
    """
    if valid.shape != values.shape[:2]:
        raise ValueError(
            f"valid must be [b, L] = {tuple(values.shape[:2])}, got {tuple(valid.shape)}"
        )
    return values[valid].unsqueeze(0)


def unpack(packed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack` (differentiable): ``[1, N, ...]`` -> ``[b, L, ...]``, 0 elsewhere."""
    flat = packed.squeeze(0)
    out = flat.new_zeros(*valid.shape, *flat.shape[1:])
    return out.index_put((valid,), flat)
