"""Typed configuration of the RL losses (torch-free dataclasses, nested into microrl.configs)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "KL_IS_ESTIMATORS",
    "KLEstimator",
    "PolicyLossConfig",
    "PolicyLossType",
    "RouterLossConfig",
    "check_ratio_band",
]


class PolicyLossType(str, Enum):
    """The policy-gradient surrogate (``policy_loss`` picks it from ``POLICY_SURROGATES``)."""

    PPO = "ppo"  # clipped surrogate (asymmetric + dual clip)
    GRPO = "grpo"  # the PPO surrogate on group-normalised advantages
    GSPO = "gspo"  # sequence-level (length-normalised) importance ratio
    CISPO = "cispo"  # clipped, stop-gradient importance weight times log-prob
    REINFORCE = "reinforce"  # plain policy gradient: -A * logprob


class KLEstimator(str, Enum):
    """Estimators of KL(pi || ref) from samples of pi (Schulman, "Approximating KL divergence", 2020)."""

    K1 = "k1"  # log r
    K2 = "k2"  # (log r)^2 / 2  (its gradient is the true KL gradient in expectation)
    K3 = "k3"  # exp(-log r) - 1 + log r, low variance, clamped
    K1_ST = "k1+"  # value of k1, gradient of k2 (straight-through)
    K3_ST = "k3+"  # value of k3, gradient of k2 (straight-through)


# Estimators whose expectation under pi is KL(pi || ref) itself, so that under samples of pi_old
# E[(pi / pi_old) * k] = KL and, with the ratio not detached, its gradient is the KL gradient. The
# k2-gradient ones (k2, k1+, k3+) are right only on-policy: a non-detached ratio would bias them.
KL_IS_ESTIMATORS = (KLEstimator.K1, KLEstimator.K3)


@dataclass
class PolicyLossConfig:
    """Surrogate, clip ranges and coefficients of :func:`microrl.losses.policy_loss`; validated on
    construction and again on every call (``ValueError`` naming the ``policy_loss.<field>``).

    Each field's one-line ``--help`` text is its ``metadata["help"]``, as in
    :mod:`microrl.configs.fields`, spelled with ``dataclasses.field`` since ``microrl.losses``
    sits below ``microrl.configs`` and imports nothing from it.
    """

    name: PolicyLossType = dataclasses.field(
        default=PolicyLossType.PPO,
        metadata={"help": "surrogate: ppo, grpo, gspo, cispo or reinforce"},
    )
    clip_ratio_low: float = dataclasses.field(
        default=0.2, metadata={"help": "ratio clip below: 1 - clip_ratio_low"}
    )
    clip_ratio_high: float = dataclasses.field(
        default=0.2, metadata={"help": "ratio clip above: 1 + clip_ratio_high"}
    )
    # Dual clip (Ye et al. 2020); must be > 1.
    clip_ratio_c: float | None = dataclasses.field(
        default=3.0, metadata={"help": "dual-clip bound for negative advantages (null: off)"}
    )
    kl_coef: float = dataclasses.field(
        default=0.0,
        metadata={"help": "weight of the KL penalty to the reference (adapter-off) policy"},
    )
    kl_estimator: KLEstimator = dataclasses.field(
        default=KLEstimator.K3, metadata={"help": "KL estimator: k1, k2, k3, k1+ or k3+"}
    )
    # Importance-sampling-corrected KL (DeepSeek-V3.2's "unbiased KL estimate"; TRL's
    # use_bias_correction_kl): the per-token KL times the unclipped, non-detached ratio pi/pi_old
    # (GSPO: the sequence ratio). Only k1 and k3, see
    # docs/losses.md#importance-sampling-corrected-kl-kl_is_correction.
    kl_is_correction: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "multiply the k1/k3 KL by the ratio pi/pi_old (DeepSeek-V3.2 unbiased KL)"
        },
    )
    entropy_coef: float = dataclasses.field(
        default=0.0, metadata={"help": "weight of the entropy bonus"}
    )
    # Rollout/trainer mismatch corrections (docs/losses.md#rollouttrainer-mismatch), all on the
    # ratio r = pi_old / pi_rollout of the batch's old_logprobs and rollout_logprobs; each None
    # disables it, and any of them set makes rollout_logprobs a required batch key.
    # Truncated importance sampling: the pg term weighted by min(r, tis_cap) (Yao et al. 2025).
    tis_cap: float | None = dataclasses.field(
        default=None, metadata={"help": "truncated importance-sampling cap (null: off)"}
    )
    # IcePop token masking: weight 0 on tokens whose r lies outside [low, high] (Ling Team 2025).
    token_ratio_band: tuple[float, float] | None = dataclasses.field(
        default=None,
        metadata={"help": "IcePop: zero pg weight where pi_old/pi_rollout is outside [low, high]"},
    )
    # Sequence masking: weight 0 on every token of a row whose geometric-mean ratio
    # exp(mean_t log r) lies outside [low, high] (Liu et al. 2025, "When Speed Kills Stability").
    seq_ratio_band: tuple[float, float] | None = dataclasses.field(
        default=None,
        metadata={"help": "zero pg weight on rows whose geometric-mean ratio is outside the band"},
    )
    # AReaL's decoupled objective for asynchronous RL (Fu et al. 2025, arXiv 2505.24298): the PPO
    # ratio is pi / pi_prox with pi_prox = old_logprobs (recomputed by the trainer), and the pg term
    # is weighted by the detached behaviour weight w = pi_prox / pi_behav (rollout_logprobs); tokens
    # with w above the cap get weight 0 (AReaL's behav_imp_weight_cap). inf: uncapped.
    decoupled_is_cap: float | None = dataclasses.field(
        default=None,
        metadata={
            "help": "AReaL's decoupled objective: pg weight pi_old/pi_rollout, 0 above this cap "
            "(> 1; inf: uncapped; null: off)"
        },
    )
    # Bypass mode (verl's rollout_correction.bypass_mode): the sampler's rollout_logprobs are the
    # ratio's anchor pi_old, so nothing recomputes old_logprobs. Exact only when the sampler ran
    # the trained weights with the trainer's numerics (docs/losses.md#bypass-mode-bypass_mode).
    bypass_mode: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "use the sampler's rollout_logprobs as old_logprobs (no old log-prob pass)"
        },
    )

    def __post_init__(self) -> None:
        self.name = _parse(PolicyLossType, self.name, "name")
        self.kl_estimator = _parse(KLEstimator, self.kl_estimator, "kl_estimator")
        for field in ("clip_ratio_low", "clip_ratio_high"):
            if not getattr(self, field) > 0:
                raise ValueError(f"policy_loss.{field} must be > 0, got {getattr(self, field)}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(
                f"policy_loss.clip_ratio_c must be > 1 or None, got {self.clip_ratio_c}"
            )
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("policy_loss.kl_coef and policy_loss.entropy_coef must be >= 0")
        if not isinstance(self.kl_is_correction, bool):
            raise ValueError(
                "policy_loss.kl_is_correction must be a bool (true or false), "
                f"got {self.kl_is_correction!r}"
            )
        if self.kl_is_correction and self.kl_estimator not in KL_IS_ESTIMATORS:
            allowed = " or ".join(repr(e.value) for e in KL_IS_ESTIMATORS)
            raise ValueError(
                "policy_loss.kl_is_correction needs policy_loss.kl_estimator "
                f"{allowed}, got {self.kl_estimator.value!r}: the ratio is not detached, so with "
                "a k2-gradient estimator it would bias the KL gradient"
            )
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"policy_loss.tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.decoupled_is_cap is not None:
            cap = self.decoupled_is_cap
            if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 1:
                raise ValueError(
                    f"policy_loss.decoupled_is_cap must be > 1 (inf: uncapped) or None, got {cap!r}"
                )
            if self.tis_cap is not None:
                raise ValueError(
                    "policy_loss.decoupled_is_cap and policy_loss.tis_cap both weight the pg term "
                    "by pi_old / pi_rollout (the decoupled objective drops tokens above its cap, "
                    "TIS truncates them): set one of them"
                )
        self.token_ratio_band = check_ratio_band(
            self.token_ratio_band, "policy_loss.token_ratio_band"
        )
        self.seq_ratio_band = check_ratio_band(self.seq_ratio_band, "policy_loss.seq_ratio_band")
        if not isinstance(self.bypass_mode, bool):
            raise ValueError(
                f"policy_loss.bypass_mode must be a bool (true or false), got {self.bypass_mode!r}"
            )
        if self.bypass_mode and self.corrects_mismatch:
            raise ValueError(
                "policy_loss.bypass_mode cannot be combined with a mismatch correction (tis_cap, "
                "token_ratio_band, seq_ratio_band, decoupled_is_cap): they weight by "
                "pi_old / pi_rollout, which the bypass makes 1"
            )

    @property
    def sequence_level_ratio(self) -> bool:
        """Whether the surrogate's importance ratio is per sequence (GSPO); the KL correction
        (``kl_is_correction``) then uses the same sequence ratio."""
        return self.name is PolicyLossType.GSPO

    @property
    def corrects_mismatch(self) -> bool:
        """Whether a rollout/trainer mismatch correction (or the decoupled objective) is on
        (then ``rollout_logprobs`` is required by the policy loss)."""
        return (
            self.tis_cap is not None
            or self.token_ratio_band is not None
            or self.seq_ratio_band is not None
            or self.decoupled_is_cap is not None
        )


@dataclass
class RouterLossConfig:
    """Coefficients of a mixture-of-experts model's router losses (docs/losses.md#router-losses),
    added to any loss of the engine's training passes; 0 turns a term off. Validated on
    construction (``ValueError`` naming the ``router_loss.<field>``).

    ``aux_loss_coef``: the model's own load-balancing loss (Switch Transformer's
    ``E * sum_e f_e * P_e``, pooled over the MoE layers as transformers computes it), over the
    whole mini-batch. ``z_loss_coef``: the router z-loss of ST-MoE (``mean logsumexp(logits)^2``
    over layers and tokens), which the supported families do not compute themselves.
    """

    aux_loss_coef: float = dataclasses.field(
        default=0.0,
        metadata={"help": "weight of the MoE load-balancing loss over the mini-batch (0: off)"},
    )
    z_loss_coef: float = dataclasses.field(
        default=0.0, metadata={"help": "weight of the MoE router z-loss (0: off)"}
    )

    def __post_init__(self) -> None:
        for field in ("aux_loss_coef", "z_loss_coef"):
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value >= 0)
            ):
                raise ValueError(f"router_loss.{field} must be a finite float >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether any router loss term is on."""
        return self.aux_loss_coef > 0 or self.z_loss_coef > 0


def check_ratio_band(band: object, name: str) -> tuple[float, float] | None:
    """``None``, or ``band`` as a ``(low, high)`` tuple of floats with ``0 <= low < high``
    (``high`` may be ``inf``: no upper bound); anything else is a ``ValueError`` naming ``name``."""
    if band is None:
        return None
    ok = isinstance(band, Sequence) and not isinstance(band, str) and len(band) == 2
    if ok:
        try:
            low, high = (float(v) for v in band)
        except (TypeError, ValueError):
            ok = False
        else:
            ok = not math.isnan(low) and not math.isnan(high) and 0 <= low < high
    if not ok:
        raise ValueError(f"{name} must be None or [low, high] with 0 <= low < high, got {band!r}")
    return (low, high)


def _parse(enum: type[Enum], value: object, field: str) -> Enum:
    try:
        return enum(value)
    except ValueError:
        names = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"policy_loss.{field} must be one of {names}, got {value!r}") from None
