"""Router losses of mixture-of-experts models as micro-batch partials of one mini-batch loss.

transformers' ``load_balancing_loss_func`` (Switch Transformer) over a batch of ``N`` real tokens
and ``L`` MoE layers with ``E`` experts::

    aux = E * sum_e f_e * P_e,   f_e = c_e / (L * N),   P_e = sum_{l,t} p_{l,t,e} / (L * N)

``c_e`` counts the top-k assignments to expert ``e`` (no gradient), ``p`` is the router's softmax.
``f`` and ``P`` are batch statistics: computed per micro-batch the loss changes with the split.
Given ``f`` and ``L * N`` of the whole mini-batch (all micro-batches, all ranks) first
(:class:`RouterDenominators`), ``aux`` is linear in the probabilities, so each micro-batch adds
``E * sum_e f_e * sum_{its l,t} p_{l,t,e} / (L * N)`` (:func:`load_balancing_partial`) and the
partials sum to the mini-batch's loss exactly. The z-loss (ST-MoE) is a per-token mean and
splits the same way (:func:`z_loss_partial`). docs/losses.md#router-losses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["RouterDenominators", "expert_counts", "load_balancing_partial", "z_loss_partial"]


@dataclass(frozen=True)
class RouterDenominators:
    """The global counts of one mini-batch's router losses (all micro-batches, all DP ranks).

    ``n_rows``: 0-d float, ``L * N``: MoE layers times real tokens, what the router
    probabilities (and the z-loss) average over. ``load``: ``[E]`` float, the load fractions
    ``f_e`` (top-k assignments to ``e`` per routed row, summing to ``k``), computed before the
    first micro-batch; None when the load-balancing loss is off. ``n_recorded``: 0-d float, the
    (token, layer) rows carrying a recorded routing (the agreement metric's denominator); None
    without a routing key.
    """

    n_rows: torch.Tensor
    load: torch.Tensor | None = None
    n_recorded: torch.Tensor | None = None


def expert_counts(experts: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Top-k assignments per expert: ``experts`` ``[..., k]`` integer ids, ``valid`` ``[...]``
    bool (rows that count; their ids must be in ``[0, E)``, others may hold anything, e.g. -1)
    -> float64 ``[E]`` (exact counts)."""
    ids = torch.where(valid.unsqueeze(-1), experts.long(), 0).reshape(-1)
    weight = valid.unsqueeze(-1).expand(experts.shape).reshape(-1).to(torch.float64)
    return torch.zeros(num_experts, dtype=torch.float64, device=ids.device).index_add_(
        0, ids, weight
    )


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for 16/32-bit logits (never a 16-bit softmax), float64 for float64 ones."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def load_balancing_partial(
    logits: Sequence[torch.Tensor], valid: torch.Tensor, denominators: RouterDenominators
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch's load-balancing loss (0-d, with gradients to
    the router logits).

    Args:
        logits: one ``[N, E]`` router-logit tensor per MoE layer, rows in the micro-batch's token
            order (the model's flattened ``[b * L]`` or packed ``[N]`` tokens).
        valid: ``[N]`` bool, the rows that are real tokens (padding and filler rows add nothing).
        denominators: the mini-batch's :class:`RouterDenominators`, with ``load`` set.
    """
    if denominators.load is None:
        raise ValueError("the load-balancing loss needs the mini-batch's load fractions")
    num_experts = denominators.load.numel()
    total = None
    for layer in logits:
        dtype = _compute_dtype(layer)
        probs = torch.softmax(layer.to(dtype), dim=-1)
        kept = torch.where(valid.unsqueeze(-1), probs, probs.new_zeros(()))
        term = (kept.sum(0) * denominators.load.to(dtype)).sum()
        total = term if total is None else total + term
    return total * num_experts / denominators.n_rows.to(total.dtype)


def z_loss_partial(
    logits: Sequence[torch.Tensor], valid: torch.Tensor, denominators: RouterDenominators
) -> torch.Tensor:
    """This micro-batch's share of the router z-loss ``sum_{l,t} logsumexp(logits)^2 / (L * N)``
    (ST-MoE: keeps the router logits small); arguments as :func:`load_balancing_partial`."""
    total = None
    for layer in logits:
        dtype = _compute_dtype(layer)
        z = torch.logsumexp(layer.to(dtype), dim=-1).square()
        term = torch.where(valid, z, z.new_zeros(())).sum()
        total = term if total is None else total + term
    return total / denominators.n_rows.to(total.dtype)
