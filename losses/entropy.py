"""Entropy bonus: the aggregated entropy of the policy on the loss tokens.

A *bonus*: the policy loss subtracts ``entropy_coef * entropy_bonus`` so that minimising the loss
keeps the policy from collapsing. Aggregated with the same ``loss_agg_mode`` and global
denominators as the policy-gradient term, so it is exact under any micro-batch split.
"""

from __future__ import annotations

import torch

from ._checks import check_agg_mode, check_denominators, check_token_inputs
from .aggregation import AggMode, LossDenominators, aggregate, masked_partial_mean
from .metrics import Metric

__all__ = ["entropy_bonus"]


def entropy_bonus(
    entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    denominators: LossDenominators,
    agg_mode: AggMode | str,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """This micro-batch's partial aggregated entropy (to be *subtracted*, times a coefficient).

    Args:
        entropy: ``[B, T]`` per-token entropy of the policy (with gradient).
        loss_mask: ``[B, T]`` bool/float; NaN/inf at masked positions are harmless.
        denominators: the mini-batch's global denominators.
        agg_mode: one of :class:`AggMode`.
        validate: check unmasked values are finite (one host sync).

    Returns:
        ``(bonus, metrics)``: a 0-d tensor (times ``grad_scale``) and ``{"entropy": token mean}``.
    """
    denominators = check_denominators(denominators)
    mode = check_agg_mode(agg_mode, denominators)
    mask = check_token_inputs(loss_mask, {"entropy": entropy}, validate=validate)
    bonus = aggregate(entropy, mask, mode, denominators)
    return bonus, {"entropy": Metric(masked_partial_mean(entropy, mask, denominators))}
