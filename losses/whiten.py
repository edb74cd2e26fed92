"""Whitening of advantages over the loss tokens of a batch."""

from __future__ import annotations

import torch

__all__ = ["WHITEN_EPS", "whiten"]

# Added to the variance before the inverse square root, as in most PPO implementations: a batch
# whose advantages are (nearly) constant is scaled by at most 1e4 instead of dividing by zero.
WHITEN_EPS = 1e-8


@torch.no_grad()
def whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = WHITEN_EPS,
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` over the masked tokens, ``[B, T]`` -> ``[B, T]``.

    Mean and unbiased variance are computed in float64 over positions where ``mask`` is set;
    masked positions (which may hold NaN) are 0 in the result. With ``shift_mean=False`` the mean
    is added back (only the scale changes). Fewer than two tokens: variance 0.

    Note: this whitens over *this* batch only; for data-parallel training, whiten the whole
    mini-batch before sharding it.
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"values and mask must both be [B, T]; got {tuple(values.shape)} and {tuple(mask.shape)}"
        )
    if not values.is_floating_point():
        raise ValueError(f"values must be floating point, got {values.dtype}")
    keep = mask.to(torch.bool)
    x = torch.where(keep, values.double(), 0.0)
    n = keep.sum()
    mean = x.sum() / n.clamp_min(1)
    centered = torch.where(keep, x - mean, 0.0)
    var = centered.square().sum() / (n - 1).clamp_min(1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = torch.where(keep, out + mean, 0.0)
    return out.to(values.dtype)
