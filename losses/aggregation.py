"""Loss aggregation: one normalisation contract, exact under any micro-batch split or DP size.

A *mini-batch* is what one optimizer step consumes, across all micro-batches and data-parallel
ranks. Every loss is defined on the whole mini-batch (docs/losses.md)::

    token-mean               sum(m * l) / N_tokens
    seq-mean-token-sum       sum_i sum_t(m * l) / N_seqs
    seq-mean-token-mean      sum_i [sum_t(m * l) / sum_t(m)] / N_seqs
    seq-mean-token-sum-norm  sum(m * l) / (N_seqs * L)

``N_tokens`` and ``N_seqs`` (sequences with at least one loss token) are counted over the whole
mini-batch *before* the first micro-batch runs (:func:`global_denominators`), and every micro-batch
returns its *partial* sum divided by them (:func:`aggregate`). Summing the partials over
micro-batches and ranks gives the mini-batch loss exactly, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist

from .router import RouterDenominators

__all__ = ["AggMode", "LossDenominators", "aggregate", "global_denominators", "masked_partial_mean"]


class AggMode(str, Enum):
    """How per-token losses of a mini-batch become one scalar."""

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"

    @classmethod
    def parse(cls, value: AggMode | str) -> AggMode:
        """Accept an ``AggMode`` or its string name; anything else is a ``ValueError``."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"loss_agg_mode must be one of {names}, got {value!r}") from None


@dataclass(frozen=True)
class LossDenominators:
    """Global denominators of one mini-batch (all micro-batches, all DP ranks).

    ``n_tokens`` and ``n_seqs`` are 0-d float tensors kept on the batch's device, so the
    micro-batch loop never syncs with the host. They are floored at 1: a mini-batch without a
    single loss token has a zero numerator, so its loss is 0, not NaN.

    ``grad_scale`` multiplies every partial loss. It equals the DP world size when the gradient
    reduction *averages* over ranks (FSDP / DDP do), so that the average of the ranks' gradients
    equals the gradient of the global sum.

    ``has_loss_tokens``: a 0-d bool tensor on the same device, whether the mini-batch holds at
    least one loss token on any rank (the floor at 1 hides it in ``n_tokens``); the engine skips
    the optimizer step of a mini-batch without any. None when built by hand.

    ``router``: a mixture-of-experts model's :class:`~microrl.losses.router.RouterDenominators`
    (its router losses' and metrics' global counts), set by the engine; None otherwise.
    """

    n_tokens: torch.Tensor
    n_seqs: torch.Tensor
    seq_len_norm: float | None = None
    grad_scale: float = 1.0
    has_loss_tokens: torch.Tensor | None = None
    router: RouterDenominators | None = None


def global_denominators(
    loss_mask: torch.Tensor,
    *,
    seq_len_norm: float | None = None,
    group: dist.ProcessGroup | None = None,
    grad_averaged_over_ranks: bool = True,
) -> LossDenominators:
    """Count loss tokens and loss sequences of this rank's share of the mini-batch, summed over ranks.

    Args:
        loss_mask: ``[B, T]`` bool/int/float, this rank's whole share of the mini-batch.
        seq_len_norm: the constant ``L`` of ``seq-mean-token-sum-norm`` (> 0).
        group: the DP process group to sum over; ``None`` uses the default group when
            torch.distributed is initialised, and no reduction otherwise.
        grad_averaged_over_ranks: whether the gradient reduction averages (sets ``grad_scale``).
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    if seq_len_norm is not None and not seq_len_norm > 0:
        raise ValueError(f"seq_len_norm must be > 0, got {seq_len_norm}")
    mask = loss_mask.to(torch.bool)
    counts = torch.stack([mask.sum(), mask.any(dim=1).sum()]).to(torch.float64)
    world = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
        world = dist.get_world_size(group)
    has_tokens = counts[0] > 0
    counts = counts.clamp_min(1.0).to(torch.float32)
    scale = float(world) if grad_averaged_over_ranks else 1.0
    return LossDenominators(counts[0], counts[1], seq_len_norm, scale, has_tokens)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode | str,
    denominators: LossDenominators,
) -> torch.Tensor:
    """This micro-batch's partial share of the mini-batch loss.

    Args:
        values: ``[B, T]`` per-token loss; entries where ``mask`` is 0 may hold anything
            (NaN, inf): they are removed with ``torch.where`` before any arithmetic.
        mask: ``[B, T]`` loss mask.
        mode: one of :class:`AggMode`.
        denominators: the mini-batch's global denominators; required, never recomputed locally.

    Returns:
        A 0-d tensor; summed over all micro-batches and ranks it is the mini-batch loss.
    """
    if not isinstance(denominators, LossDenominators):
        raise TypeError(
            "denominators must be the mini-batch's LossDenominators (from global_denominators); "
            f"got {type(denominators).__name__}"
        )
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"values and mask must both be [B, T]; got {tuple(values.shape)} and {tuple(mask.shape)}"
        )
    mode = AggMode.parse(mode)
    keep = mask.to(torch.bool)
    weighted = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if mode is AggMode.TOKEN_MEAN:
        total = weighted.sum() / denominators.n_tokens
    elif mode is AggMode.SEQ_MEAN_TOKEN_SUM:
        total = weighted.sum() / denominators.n_seqs
    elif mode is AggMode.SEQ_MEAN_TOKEN_MEAN:
        per_seq = weighted.sum(dim=1) / keep.sum(dim=1).clamp_min(1)
        total = per_seq.sum() / denominators.n_seqs
    else:
        if denominators.seq_len_norm is None:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs seq_len_norm (L)")
        total = weighted.sum() / (denominators.n_seqs * denominators.seq_len_norm)
    return total * denominators.grad_scale


def masked_partial_mean(
    values: torch.Tensor, mask: torch.Tensor, denominators: LossDenominators
) -> torch.Tensor:
    """Partial token-weighted mean of a *metric* (no ``grad_scale``): sums to the global mean.

    ``values`` and ``mask`` are ``[B, T]``; the result is a detached 0-d float32 tensor.
    """
    keep = mask.to(torch.bool)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return (torch.where(keep, values.detach(), zero).sum() / denominators.n_tokens).float()
