"""The policy loss: one surrogate (picked from a small registry) + KL penalty - entropy bonus.

``policy_loss`` is what the actor engine calls once per micro-batch. It validates its inputs at
this public boundary, removes masked positions with ``torch.where`` before any arithmetic (NaN/inf
there reach neither the loss, a metric nor a gradient), and returns this micro-batch's *partial*
loss under the global denominators plus summable detached metrics (docs/losses.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import check_agg_mode, check_denominators, check_token_inputs, unscaled
from .aggregation import AggMode, LossDenominators, aggregate, masked_partial_mean
from .cispo import cispo_surrogate
from .config import PolicyLossConfig, PolicyLossType
from .gspo import gspo_surrogate
from .kl import kl_penalty
from .metrics import Metric, Reduce
from .mismatch import mismatch_metrics, rollout_correction
from .ppo import ppo_surrogate
from .ratio import SurrogateOutput, importance_ratio
from .reinforce import reinforce_surrogate

__all__ = ["POLICY_SURROGATES", "Surrogate", "policy_loss"]

# (logprobs, old_logprobs, advantages, bool mask, config) -> per-token SurrogateOutput
Surrogate = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyLossConfig], SurrogateOutput
]

POLICY_SURROGATES: dict[PolicyLossType, Surrogate] = {
    PolicyLossType.PPO: ppo_surrogate,
    PolicyLossType.GRPO: ppo_surrogate,  # the advantage estimator makes GRPO, not the surrogate
    PolicyLossType.GSPO: gspo_surrogate,
    PolicyLossType.CISPO: cispo_surrogate,
    PolicyLossType.REINFORCE: reinforce_surrogate,
}


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    denominators: LossDenominators,
    config: PolicyLossConfig,
    agg_mode: AggMode | str,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """This micro-batch's partial policy loss and its metrics.

    ``loss = agg(w * pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``, each ``agg`` the
    configured ``loss_agg_mode`` over the mini-batch's global denominators (times ``grad_scale``),
    ``pg`` the per-token surrogate of ``config.name`` and ``w`` the rollout/trainer mismatch
    correction (:func:`~microrl.losses.rollout_correction`: truncated IS, token and sequence
    masking, AReaL's decoupled behaviour weight; 1 without any). With ``config.kl_is_correction`` the per-token ``kl`` is multiplied
    by the non-detached ratio ``pi / pi_old`` (per sequence for GSPO) before ``agg``. Summed over
    micro-batches and ranks it is the mini-batch loss.

    Args:
        logprobs: ``[B, T]`` log-probs of the taken tokens under the trained policy (with grad).
        old_logprobs: ``[B, T]`` behaviour-policy log-probs (gradient ignored); ``None`` with
            ``config.bypass_mode``, where ``rollout_logprobs`` take their place.
        advantages: ``[B, T]`` per-token advantages (a per-sequence ``[B]`` advantage is spread
            with :func:`microrl.losses.broadcast_to_tokens`).
        loss_mask: ``[B, T]`` bool/int/float; nonzero marks a trained token.
        denominators: the mini-batch's :class:`LossDenominators` (from ``global_denominators``).
        config: the :class:`PolicyLossConfig` (surrogate, clips, coefficients).
        agg_mode: a :class:`AggMode` or its name.
        ref_logprobs: ``[B, T]`` reference log-probs; required iff ``config.kl_coef > 0``
            (also accepted, for the ``kl`` metric, when it is 0).
        entropy: ``[B, T]`` per-token entropy (with grad); required iff ``entropy_coef > 0``.
        rollout_logprobs: ``[B, T]`` log-probs the rollout backend sampled the tokens with;
            required iff a mismatch correction is configured (``tis_cap``,
            ``token_ratio_band``, ``seq_ratio_band``, ``decoupled_is_cap``) or ``bypass_mode``
            is on; whenever given,
            the ``mismatch/*`` metrics compare it with ``old_logprobs`` (with ``bypass_mode``:
            with the detached ``logprobs``, see docs/losses.md#bypass-mode-bypass_mode).
        validate: check that every unmasked input value is finite (one host sync per call).

    Returns:
        ``(loss, metrics)``: a 0-d tensor with gradient and detached :class:`Metric` s:
        ``pg_loss`` (the aggregated pg term, without ``grad_scale``), ``pg_clipfrac`` (=
        ``pg_clipfrac_lower + pg_clipfrac_upper``), ``pg_clipfrac_dual`` (when a dual clip is
        configured), ``ppo_kl`` (token mean of ``log pi_old - log pi``), ``ratio_min``,
        ``ratio_max``; ``kl`` (uncorrected) and ``kl_loss`` (the aggregated KL term) with
        ``ref_logprobs``, and ``kl_is`` (token mean of the corrected KL) with
        ``kl_is_correction`` too; ``entropy`` with ``entropy``; with ``rollout_logprobs``
        the ``mismatch/*`` metrics
        (:func:`~microrl.losses.mismatch_metrics`) and those of the configured corrections
        (``tis_weight_mean``, ``tis_clipfrac``, ``mismatch/token_mask_frac``,
        ``mismatch/seq_mask_frac``, ``decoupled_is_weight_mean``, ``decoupled_is_capped_frac``). Fractions and means are token-weighted over the mini-batch.
    """
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    config.__post_init__()  # re-validate: the dataclass is mutable (cheap, no tensors involved)
    denominators = check_denominators(denominators)
    mode = check_agg_mode(agg_mode, denominators)
    if config.bypass_mode:
        # The sampler's log-probs are the behaviour policy itself (verl's bypass mode).
        if old_logprobs is not None:
            raise ValueError(
                "old_logprobs must be None with policy_loss.bypass_mode: rollout_logprobs are "
                "the behaviour log-probs"
            )
        if rollout_logprobs is None:
            raise ValueError("rollout_logprobs is required because policy_loss.bypass_mode is on")
        old_logprobs = rollout_logprobs
    elif old_logprobs is None:
        raise ValueError(
            "old_logprobs is required (or policy_loss.bypass_mode, to use rollout_logprobs)"
        )
    inputs = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages}
    _require(inputs, "ref_logprobs", ref_logprobs, config.kl_coef > 0, "policy_loss.kl_coef > 0")
    _require(inputs, "entropy", entropy, config.entropy_coef > 0, "policy_loss.entropy_coef > 0")
    _require(
        inputs,
        "rollout_logprobs",
        rollout_logprobs,
        config.corrects_mismatch,
        "a rollout/trainer mismatch correction is configured "
        "(policy_loss.tis_cap, token_ratio_band, seq_ratio_band or decoupled_is_cap)",
    )
    mask = check_token_inputs(loss_mask, inputs, validate=validate)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    clean = {name: torch.where(mask, t, zero) for name, t in inputs.items()}

    out = POLICY_SURROGATES[config.name](
        clean["logprobs"],
        clean["old_logprobs"].detach(),
        clean["advantages"].detach(),
        mask,
        config,
    )
    pg = out.loss
    metrics: dict[str, Metric] = {}
    if "rollout_logprobs" in clean and config.bypass_mode:
        # pi_old is mu itself, so the gap is measured against this pass: exactly the
        # trainer/sampler gap on an update at the sampling weights, plus the drift after it.
        metrics.update(
            mismatch_metrics(
                clean["logprobs"].detach(),
                clean["rollout_logprobs"],
                mask,
                denominators,
                validate=False,
            )
        )
    elif "rollout_logprobs" in clean:
        # The mismatch between the trainer's behaviour log-probs and the rollout backend's
        # (docs/losses.md#rollouttrainer-mismatch), and its corrections on the pg term.
        behaviour = (clean["old_logprobs"], clean["rollout_logprobs"], mask, denominators)
        metrics.update(mismatch_metrics(*behaviour, validate=False))
        if config.corrects_mismatch:
            correction = rollout_correction(
                *behaviour,
                tis_cap=config.tis_cap,
                token_band=config.token_ratio_band,
                seq_band=config.seq_ratio_band,
                decoupled_cap=config.decoupled_is_cap,
                validate=False,
            )
            pg = pg * correction.weights.to(pg.dtype)
            metrics.update(correction.metrics)

    plain = unscaled(denominators)
    pg_term = aggregate(pg, mask, mode, plain)
    total = pg_term
    metrics["pg_loss"] = Metric(pg_term.detach().float())
    metrics.update(_surrogate_metrics(out, mask, denominators))

    if "ref_logprobs" in clean:
        kl = kl_penalty(clean["logprobs"], clean["ref_logprobs"], config.kl_estimator)
        metrics["kl"] = Metric(masked_partial_mean(kl, mask, denominators))
        if config.kl_is_correction:
            # DeepSeek-V3.2's unbiased KL: the tokens come from pi_old, so weight by pi / pi_old;
            # the ratio is not detached, which makes the gradient the KL gradient under pi.
            kl = kl * importance_ratio(
                clean["logprobs"],
                clean["old_logprobs"].detach(),
                mask,
                sequence_level=config.sequence_level_ratio,
            )
            metrics["kl_is"] = Metric(masked_partial_mean(kl, mask, denominators))
        kl_term = aggregate(kl, mask, mode, plain)
        metrics["kl_loss"] = Metric(kl_term.detach().float())
        if config.kl_coef > 0:
            total = total + config.kl_coef * kl_term
    if "entropy" in clean:
        metrics["entropy"] = Metric(masked_partial_mean(clean["entropy"], mask, denominators))
        if config.entropy_coef > 0:
            total = total - config.entropy_coef * aggregate(clean["entropy"], mask, mode, plain)
    return total * denominators.grad_scale, metrics


def _require(
    inputs: dict[str, torch.Tensor],
    name: str,
    tensor: torch.Tensor | None,
    required: bool,
    because: str,
) -> None:
    if tensor is not None:
        inputs[name] = tensor
    elif required:
        raise ValueError(f"{name} is required because {because}")


def _surrogate_metrics(
    out: SurrogateOutput, mask: torch.Tensor, denominators: LossDenominators
) -> dict[str, Metric]:
    def fraction(flags: torch.Tensor) -> Metric:
        return Metric(masked_partial_mean(flags.float(), mask, denominators))

    if mask.numel() == 0:  # an empty micro-batch: the reduction identities
        ratio_min = Metric.empty(Reduce.MIN, mask.device)
        ratio_max = Metric.empty(Reduce.MAX, mask.device)
    else:
        inf = torch.tensor(float("inf"), dtype=out.ratio.dtype, device=out.ratio.device)
        ratio_min = Metric(torch.where(mask, out.ratio, inf).min().float(), Reduce.MIN)
        ratio_max = Metric(torch.where(mask, out.ratio, -inf).max().float(), Reduce.MAX)
    metrics = {
        "pg_clipfrac": fraction(out.clipped_lower | out.clipped_upper),
        "pg_clipfrac_lower": fraction(out.clipped_lower),
        "pg_clipfrac_upper": fraction(out.clipped_upper),
        # k1 estimate of KL(pi_old || pi) on the sampled tokens: how far this update has moved.
        "ppo_kl": Metric(masked_partial_mean(-out.log_ratio, mask, denominators)),
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
    }
    if out.clipped_dual is not None:
        metrics["pg_clipfrac_dual"] = fraction(out.clipped_dual)
    return metrics
