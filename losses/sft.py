"""Supervised fine-tuning loss: the negative log-likelihood of the loss tokens."""

from __future__ import annotations

import torch

from ._checks import check_agg_mode, check_denominators, check_token_inputs, unscaled
from .aggregation import AggMode, LossDenominators, aggregate
from .metrics import Metric

__all__ = ["sft_loss"]


def sft_loss(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    denominators: LossDenominators,
    agg_mode: AggMode | str,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """This micro-batch's partial NLL ``agg(-logprobs)`` and ``{"sft_loss": ...}``.

    Args:
        logprobs: ``[B, T]`` log-probs of the target tokens (with gradient).
        loss_mask: ``[B, T]`` bool/int/float; NaN/inf at masked positions are harmless.
        denominators: the mini-batch's global denominators.
        agg_mode: a :class:`AggMode` or its name (``token-mean`` is the usual SFT choice).
        validate: check that unmasked values are finite (one host sync).

    Returns:
        The partial loss (times ``grad_scale``) and ``sft_loss``, the aggregated NLL without
        ``grad_scale`` (summed over micro-batches and ranks it is the mini-batch NLL).
    """
    denominators = check_denominators(denominators)
    mode = check_agg_mode(agg_mode, denominators)
    mask = check_token_inputs(loss_mask, {"logprobs": logprobs}, validate=validate)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    nll = -torch.where(mask, logprobs, zero)
    term = aggregate(nll, mask, mode, unscaled(denominators))
    return term * denominators.grad_scale, {"sft_loss": Metric(term.detach().float())}
