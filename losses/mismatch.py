"""Rollout/trainer log-prob mismatch: metrics and corrections (docs/losses.md).

The rollout backend (vLLM, HF ``generate``) samples the tokens with its own kernels, precision and
batch composition. So the log-probs it reports (``rollout_logprobs``, the behaviour policy ``mu``)
differ from the trainer's recomputation at the same weights (``old_logprobs``, ``pi_old``), and
training is silently off-policy. Every quantity here is per loss token, on
``r = exp(log pi_old - log mu)``: the metrics measure the gap, the corrections (truncated IS,
token and sequence masking, AReaL's decoupled weight) reweight the policy-gradient loss by a
detached weight. Masked tokens keep counting in the global denominators, so every correction
stays exact under any micro-batch split and rank count. The metrics, the corrections and their
references are in docs/losses.md, "Rollout/trainer mismatch".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_denominators, check_token_inputs
from .aggregation import LossDenominators, masked_partial_mean
from .config import check_ratio_band
from .metrics import Metric, Reduce
from .ratio import LOG_RATIO_CLAMP

__all__ = [
    "MISMATCH_METRICS",
    "RolloutCorrection",
    "mismatch_log_ratio",
    "mismatch_metrics",
    "rollout_correction",
]

#: The names :func:`mismatch_metrics` reports.
MISMATCH_METRICS = (
    "mismatch/abs_diff_mean",
    "mismatch/abs_diff_max",
    "mismatch/kl_k3",
    "mismatch/mult_prob_error",
)


def mismatch_log_ratio(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``delta = clamp(train - rollout, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)`` on ``mask``, 0 elsewhere.

    Detached, ``[B, T]``, in the promoted dtype of the two inputs. Masked positions are removed
    with ``torch.where`` before the subtraction, so NaN/inf there never reach the result. The
    clamp keeps ``exp(delta)`` finite (see :data:`LOG_RATIO_CLAMP`).
    """
    dtype = torch.promote_types(train_logprobs.dtype, rollout_logprobs.dtype)
    keep = mask.to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=train_logprobs.device)
    train = torch.where(keep, train_logprobs.detach().to(dtype), zero)
    rollout = torch.where(keep, rollout_logprobs.detach().to(dtype), zero)
    return (train - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def mismatch_metrics(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    denominators: LossDenominators,
    *,
    validate: bool = True,
) -> dict[str, Metric]:
    """This micro-batch's share of the mismatch metrics (:data:`MISMATCH_METRICS`).

    Args:
        train_logprobs: ``[B, T]`` the trainer's log-probs of the sampled tokens at the sampling
            weights (``old_logprobs``; the engine falls back to the current ``logprobs`` for a
            custom loss without ``old_logprobs``). Not differentiated.
        rollout_logprobs: ``[B, T]`` the rollout backend's log-probs of the same tokens.
        loss_mask: ``[B, T]``; only loss tokens count.
        denominators: the mini-batch's :class:`LossDenominators` (the means divide by its
            ``n_tokens``, so the ``SUM`` partials add up to the mini-batch mean).
        validate: check the inputs are finite on loss tokens (one host sync).

    Returns:
        ``mismatch/abs_diff_mean``, ``mismatch/kl_k3``, ``mismatch/mult_prob_error`` (``SUM``
        partials of token means) and ``mismatch/abs_diff_max`` (``MAX``; NaN after reduction
        when the mini-batch has no loss token).
    """
    denominators = check_denominators(denominators)
    mask = check_token_inputs(
        loss_mask,
        {"train_logprobs": train_logprobs, "rollout_logprobs": rollout_logprobs},
        validate=validate,
    )
    delta = mismatch_log_ratio(train_logprobs, rollout_logprobs, mask)
    abs_delta = delta.abs()
    if mask.numel() == 0:
        abs_max = Metric.empty(Reduce.MAX, mask.device)
    else:
        neg_inf = torch.tensor(float("-inf"), dtype=delta.dtype, device=delta.device)
        abs_max = Metric(torch.where(mask, abs_delta, neg_inf).max().float(), Reduce.MAX)
    return {
        "mismatch/abs_diff_mean": Metric(masked_partial_mean(abs_delta, mask, denominators)),
        "mismatch/abs_diff_max": abs_max,
        # k3 of KL(mu || pi_train) with r = pi_train / mu: r - 1 - log r (0 off the mask).
        "mismatch/kl_k3": Metric(
            masked_partial_mean(torch.expm1(delta) - delta, mask, denominators)
        ),
        "mismatch/mult_prob_error": Metric(
            masked_partial_mean(torch.exp(abs_delta), mask, denominators)
        ),
    }


@dataclass(frozen=True)
class RolloutCorrection:
    """What :func:`rollout_correction` returns.

    Attributes:
        weights: ``[B, T]`` detached weight of each token's policy-gradient loss: the truncated
            IS weight (or the decoupled weight; 1 without ``tis_cap`` and ``decoupled_cap``)
            times 0 where a mask removes the token; 0 off the loss mask.
        token_masked: ``[B, T]`` bool, loss tokens outside ``token_band``, or None without it.
        seq_masked: ``[B]`` bool, rows with loss tokens whose geometric-mean ratio lies outside
            ``seq_band``, or None without it.
        metrics: ``tis_weight_mean``, ``tis_clipfrac`` (with ``tis_cap``),
            ``mismatch/token_mask_frac`` (with ``token_band``: the fraction of loss tokens it
            removes), ``mismatch/seq_mask_frac`` (with ``seq_band``: the fraction of sequences
            it removes, over the mini-batch's ``n_seqs``), ``decoupled_is_weight_mean`` and
            ``decoupled_is_capped_frac`` (with ``decoupled_cap``: the mean weight after the cap,
            the fraction of loss tokens the cap drops).
    """

    weights: torch.Tensor
    token_masked: torch.Tensor | None
    seq_masked: torch.Tensor | None
    metrics: dict[str, Metric]


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    denominators: LossDenominators,
    *,
    tis_cap: float | None = None,
    token_band: tuple[float, float] | None = None,
    seq_band: tuple[float, float] | None = None,
    decoupled_cap: float | None = None,
    validate: bool = True,
) -> RolloutCorrection:
    """Per-token weights that correct the rollout/trainer mismatch of this micro-batch.

    With ``r = exp(clamp(old_logprobs - rollout_logprobs))`` per loss token::

        weights = min(r, tis_cap)                         (1 without tis_cap)
                  or r * [r <= decoupled_cap]             (decoupled_cap: AReaL)
                * [low_t <= r <= high_t]                  (token_band: IcePop)
                * [low_s <= exp(mean_t log r) <= high_s]  (seq_band: geometric-mean masking)

    Multiply the per-token policy-gradient loss by ``weights`` before :func:`aggregate` (as
    :func:`policy_loss` does); the weights are detached, so a masked token gets exactly zero
    gradient, and the denominators are unchanged (a masked token still counts in ``N_tokens``).
    A row's tokens are never split across micro-batches, so the per-row geometric mean is
    exact. To drop masked tokens from the denominators instead, call this once on the whole
    mini-batch and train on ``loss_mask & (weights > 0)`` without the bands.

    ``token_band=(low, high)`` with ``tis_cap=high`` is IcePop's weight exactly: ``r`` inside
    the band, 0 outside.

    Args:
        old_logprobs: ``[B, T]`` the trainer's log-probs at the sampling weights (behaviour
            policy as the trainer computes it). Not differentiated.
        rollout_logprobs: ``[B, T]`` the rollout backend's log-probs of the same tokens.
        loss_mask: ``[B, T]``.
        denominators: the mini-batch's :class:`LossDenominators` (for the metrics).
        tis_cap: truncated IS cap ``> 0``, or None.
        decoupled_cap: AReaL's behaviour-weight cap ``> 1`` (``inf``: uncapped), or None; not
            together with ``tis_cap`` (both weight by ``r``).
        token_band, seq_band: ``(low, high)`` with ``0 <= low < high``, or None.
        validate: check the inputs are finite on loss tokens (one host sync).
    """
    denominators = check_denominators(denominators)
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0 or None, got {tis_cap}")
    if decoupled_cap is not None and not decoupled_cap > 1:
        raise ValueError(f"decoupled_cap must be > 1 or None, got {decoupled_cap}")
    if decoupled_cap is not None and tis_cap is not None:
        raise ValueError("tis_cap and decoupled_cap both weight by r: give one of them")
    token_band = check_ratio_band(token_band, "token_band")
    seq_band = check_ratio_band(seq_band, "seq_band")
    mask = check_token_inputs(
        loss_mask,
        {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs},
        validate=validate,
    )
    delta = mismatch_log_ratio(old_logprobs, rollout_logprobs, mask)
    zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
    ratio = torch.exp(delta)  # finite: delta is clamped
    metrics: dict[str, Metric] = {}
    if tis_cap is not None:
        weights = ratio.clamp(max=tis_cap)  # truncated IS weights
        metrics["tis_weight_mean"] = Metric(masked_partial_mean(weights, mask, denominators))
        capped = (weights >= tis_cap).to(weights.dtype)
        metrics["tis_clipfrac"] = Metric(masked_partial_mean(capped, mask, denominators))
    elif decoupled_cap is not None:
        # AReaL's behaviour weight: r itself, 0 on tokens whose r exceeds the cap (dropped, not
        # truncated: a token that stale says little about the current policy).
        over = mask & (ratio > decoupled_cap)
        weights = torch.where(over, zero, ratio)
        metrics["decoupled_is_weight_mean"] = Metric(
            masked_partial_mean(weights, mask, denominators)
        )
        metrics["decoupled_is_capped_frac"] = Metric(
            masked_partial_mean(over.to(delta.dtype), mask, denominators)
        )
    else:
        weights = torch.ones_like(delta)
    keep = mask
    token_masked = seq_masked = None
    if token_band is not None:
        token_masked = mask & ((ratio < token_band[0]) | (ratio > token_band[1]))
        keep = keep & ~token_masked
        metrics["mismatch/token_mask_frac"] = Metric(
            masked_partial_mean(token_masked.to(delta.dtype), mask, denominators)
        )
    if seq_band is not None:
        has_tokens = mask.any(dim=1)
        # delta is 0 off the mask: the row sum is over its loss tokens (a row without: ratio 1).
        seq_ratio = torch.exp(delta.sum(dim=1) / mask.sum(dim=1).clamp_min(1))
        seq_masked = has_tokens & ((seq_ratio < seq_band[0]) | (seq_ratio > seq_band[1]))
        keep = keep & ~seq_masked[:, None]
        metrics["mismatch/seq_mask_frac"] = Metric((seq_masked.sum() / denominators.n_seqs).float())
    weights = torch.where(keep, weights, zero)
    return RolloutCorrection(weights, token_masked, seq_masked, metrics)
