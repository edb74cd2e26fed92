"""Sequence packing: a right-padded ``[b, L]`` micro-batch as one ``[1, N]`` row without padding.

The real tokens of every row are concatenated; position ids restart at 0 for each sequence.
transformers (>= 5) recognises this layout when it gets ``position_ids`` and *no* attention mask
(``masking_utils.find_packed_sequence_indices``: a position that does not follow its predecessor
by +1 starts a new sequence) and builds a block-diagonal causal mask for the eager/SDPA/flex
kernels, or passes sequence boundaries to flash-attention. So each token attends exactly to the
tokens of its own sequence, as in the padded layout, and the ``b * L - N`` padding tokens cost
nothing.

No host sync: boolean-mask indexing (``values[valid]``) would have to read the mask's count back
from the device on every micro-batch; the engine knows ``N`` on the host already (the row lengths
it planned with), so the flat indices come from ``torch.nonzero_static`` with that size.
"""

from __future__ import annotations

import torch

__all__ = ["pack", "packed_index", "unpack"]


def packed_index(valid: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Row-major flat indices ``[N]`` of the ``True`` entries of ``valid [b, L]``.

    ``num_tokens`` must equal ``valid.sum()`` (known on the host, so nothing syncs); row-major
    order keeps each sequence contiguous and the sequences in row order.
    """
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
