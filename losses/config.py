"""Typed configuration of the RL losses (torch-free dataclasses, nested into microrl.configs)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["KLEstimator", "PolicyLossConfig", "PolicyLossType"]


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


@dataclass
class PolicyLossConfig:
    """Surrogate, clip ranges and coefficients of :func:`microrl.losses.policy_loss`; validated on
    construction and again on every call (``ValueError`` naming the ``policy_loss.<field>``)."""

    name: PolicyLossType = PolicyLossType.PPO
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # Dual clip (Ye et al. 2020) for negative advantages; None disables it. Must be > 1.
    clip_ratio_c: float | None = 3.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0
    # Truncated importance sampling cap for rollout/training mismatch; None disables it.
    tis_cap: float | None = None

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
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"policy_loss.tis_cap must be > 0 or None, got {self.tis_cap}")


def _parse(enum: type[Enum], value: object, field: str) -> Enum:
    try:
        return enum(value)
    except ValueError:
        names = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"policy_loss.{field} must be one of {names}, got {value!r}") from None
