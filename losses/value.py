"""Clipped value loss for the critic (PPO, Schulman et al. 2017; the clip as in OpenAI baselines).

Per token, with ``v`` the new value, ``v_old`` the value at rollout time and ``R`` the return::

    l = 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)

The clip keeps the critic from moving far from its rollout-time estimate in one update;
``cliprange_value=None`` gives the plain ``0.5 * (v - R)^2``.
"""

from __future__ import annotations

import torch

from ._checks import check_agg_mode, check_denominators, check_token_inputs, unscaled
from .aggregation import AggMode, LossDenominators, aggregate, masked_partial_mean
from .metrics import Metric

__all__ = ["value_loss"]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    denominators: LossDenominators,
    agg_mode: AggMode | str,
    *,
    cliprange_value: float | None,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """This micro-batch's partial value loss and its metrics.

    Args:
        values: ``[B, T]`` predicted values (with gradient).
        old_values: ``[B, T]`` values at rollout time (gradient ignored).
        returns: ``[B, T]`` regression targets, e.g. from :func:`gae_advantages`.
        loss_mask: ``[B, T]`` bool/int/float; NaN/inf at masked positions are harmless.
        denominators: the mini-batch's global denominators.
        agg_mode: a :class:`AggMode` or its name.
        cliprange_value: ``c > 0``, or ``None`` for no clipping.
        validate: check that unmasked values are finite (one host sync).

    Returns:
        ``(loss, metrics)``: the partial loss (times ``grad_scale``) and ``vf_loss`` (the
        aggregated loss without ``grad_scale``), ``vf_clipfrac`` (fraction of tokens where the
        clipped term is the larger, i.e. the clip binds), ``vpred_mean``, ``vf_error`` (mean of
        ``(v - R)^2``), token-weighted over the mini-batch.
    """
    denominators = check_denominators(denominators)
    mode = check_agg_mode(agg_mode, denominators)
    if cliprange_value is not None and not cliprange_value > 0:
        raise ValueError(f"cliprange_value must be > 0 or None, got {cliprange_value}")
    inputs = {"values": values, "old_values": old_values, "returns": returns}
    mask = check_token_inputs(loss_mask, inputs, validate=validate)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v, v_old, ret = (torch.where(mask, t, zero) for t in inputs.values())
    v_old, ret = v_old.detach(), ret.detach()
    unclipped = (v - ret).square()
    if cliprange_value is None:
        per_token = 0.5 * unclipped
        clipped_frac = torch.zeros_like(mask, dtype=torch.float32)
    else:
        v_clipped = v_old + (v - v_old).clamp(-cliprange_value, cliprange_value)
        clipped = (v_clipped - ret).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_frac = (clipped > unclipped).float()
    term = aggregate(per_token, mask, mode, unscaled(denominators))
    metrics = {
        "vf_loss": Metric(term.detach().float()),
        "vf_clipfrac": Metric(masked_partial_mean(clipped_frac, mask, denominators)),
        "vpred_mean": Metric(masked_partial_mean(v, mask, denominators)),
        "vf_error": Metric(masked_partial_mean(unclipped, mask, denominators)),
    }
    return term * denominators.grad_scale, metrics
