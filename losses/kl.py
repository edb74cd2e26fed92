"""Per-token KL penalty to a reference policy.

Estimators of ``KL(pi || ref)`` from tokens sampled from ``pi`` (J. Schulman, "Approximating KL
Divergence", 2020), with ``log_r = log pi - log ref``:

* ``k1 = log_r``: unbiased, high variance, can be negative per token.
* ``k2 = log_r^2 / 2``: biased, but its gradient is the gradient of the true KL in expectation
  (on-policy), which is why it is the right thing to *differentiate*.
* ``k3 = exp(-log_r) - 1 + log_r``: unbiased, non-negative, low variance (GRPO's choice).
* ``k1+`` / ``k3+``: straight-through: the *value* of k1 / k3 (what is reported and added to the
  loss) with the *gradient* of k2.

``policy_loss`` can importance-weight k1 / k3 by ``pi / pi_old`` (``kl_is_correction``,
DeepSeek-V3.2's unbiased KL estimate), see
docs/losses.md#importance-sampling-corrected-kl-kl_is_correction.
"""

from __future__ import annotations

import torch

from .config import KLEstimator

__all__ = ["K3_MAX", "KL_LOG_RATIO_CLAMP", "kl_penalty"]

# log(pi / ref) is clamped before ``exp`` in k3: exp(20) ~ 4.9e8 is finite in float32/bfloat16, and
# a token that far from the reference is already penalised at the clamp, so the clamp keeps an
# inf (and a NaN gradient) out of the loss without changing any realistic value.
KL_LOG_RATIO_CLAMP = 20.0
# k3 per token is capped at 10: beyond that one token's penalty would dominate a whole
# mini-batch's loss (exp grows without bound as log_r -> -inf); verl and OpenRLHF cap it likewise.
K3_MAX = 10.0


def _parse(estimator: KLEstimator | str) -> KLEstimator:
    try:
        return KLEstimator(estimator)
    except ValueError:
        names = ", ".join(repr(e.value) for e in KLEstimator)
        raise ValueError(f"kl estimator must be one of {names}, got {estimator!r}") from None


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: KLEstimator | str,
    *,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate, ``[B, T]`` (any shape; both inputs alike).

    Args:
        logprobs: log-probs of the sampled tokens under the trained policy (with gradient).
        ref_logprobs: log-probs of the same tokens under the reference policy (no gradient used).
        estimator: one of :class:`KLEstimator` or its name (``"k1"``, ``"k2"``, ``"k3"``,
            ``"k1+"``, ``"k3+"``).
        mask: optional loss mask; masked positions are removed with ``torch.where`` before any
            arithmetic, so they hold 0 and NaN/inf there reaches neither value nor gradient.
    """
    kind = _parse(estimator)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs must have the shape of logprobs {tuple(logprobs.shape)}, "
            f"got {tuple(ref_logprobs.shape)}"
        )
    ref_logprobs = ref_logprobs.detach()
    if mask is not None:
        keep = mask.to(torch.bool)
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        logprobs = torch.where(keep, logprobs, zero)
        ref_logprobs = torch.where(keep, ref_logprobs, zero)
    log_r = logprobs - ref_logprobs
    if kind is KLEstimator.K1:
        return log_r
    k2 = 0.5 * log_r.square()
    if kind is KLEstimator.K2:
        return k2
    if kind is KLEstimator.K1_ST:
        return k2 + (log_r - k2).detach()
    clamped = log_r.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    k3 = (torch.exp(-clamped) - 1.0 + clamped).clamp(max=K3_MAX)
    if kind is KLEstimator.K3:
        return k3
    return k2 + (k3 - k2).detach()
