"""Whitening of advantages over the loss tokens of a batch, optionally over all data-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

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
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` over the masked tokens, ``[B, T]`` -> ``[B, T]``.

    Mean and unbiased variance are computed in float64 over positions where ``mask`` is set;
    masked positions (which may hold NaN) are 0 in the result. With ``shift_mean=False`` the mean
    is added back (only the scale changes). Fewer than two tokens: variance 0.

    Data parallelism: with ``group=None`` the statistics are those of *this* batch only. Pass the
    data-parallel process group (``microrl.engine.parallel.distributed.dp_group()``) and they are those
    of the mini-batch over all ranks of ``group``, each rank passing its own rows (any number,
    also 0; ``T`` may differ between ranks): the result on each rank equals its rows of
    ``whiten`` applied to the concatenation of all ranks' rows in one process. It is a
    collective: every rank of ``group`` must call it.

    Two float64 all-reduces of two and one numbers: first the token sum and the token count
    (-> the global mean), then the sum of squared deviations from that mean (-> the unbiased
    variance over the global token count ``N``, divided by ``N - 1``). The second pass costs one
    more collective but avoids the cancellation of ``E[x^2] - E[x]^2`` when the mean is large
    against the spread. The count is exact (an integer in float64); the sums differ from the
    one-process sums only in float64 summation order (relative ~1e-16, far below the float32
    the result is usually returned in).
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"values and mask must both be [B, T]; got {tuple(values.shape)} and {tuple(mask.shape)}"
        )
    if not values.is_floating_point():
        raise ValueError(f"values must be floating point, got {values.dtype}")
    if group is not None:
        _check_group(group)
    keep = mask.to(torch.bool)
    x = torch.where(keep, values.double(), 0.0)
    totals = torch.stack([x.sum(), keep.sum().double()])  # [sum, count]
    totals = _all_reduce(totals, group)
    n = totals[1]
    mean = totals[0] / n.clamp_min(1)
    centered = torch.where(keep, x - mean, 0.0)
    squares = _all_reduce(centered.square().sum().reshape(1), group)[0]
    var = squares / (n - 1).clamp_min(1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = torch.where(keep, out + mean, 0.0)
    return out.to(values.dtype)


def _check_group(group: object) -> None:
    if not dist.is_available():
        raise ValueError("group was given but torch.distributed is not available in this build")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialised")


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` (float64) over ``group``; unchanged without one. A group with no backend
    for the tensor's device (NCCL alone) reduces on the current GPU: a CPU tensor travels there
    and back (a few numbers)."""
    if group is None:
        return tensor
    device = tensor.device
    backends = dist.BackendConfig(dist.get_backend(group)).get_device_backend_map()
    if device.type not in backends and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = tensor.to(device)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
    return buffer.to(tensor.device)
