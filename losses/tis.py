"""Truncated importance sampling for the rollout/training mismatch.

The rollout engine (vLLM, SGLang) samples with slightly different numerics than the trainer, so
``old_logprobs`` (recomputed by the trainer) differ from the ``rollout_logprobs`` the tokens were
actually drawn with. Weighting each token's policy-gradient loss by
``w = min(pi_old / pi_rollout, cap)`` (detached) corrects the bias; the cap bounds the variance
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").

:func:`microrl.losses.rollout_correction` (mismatch.py) applies this weight together with the
token and sequence masks, on the same ratio ``pi_old / pi_rollout``.
"""

from __future__ import annotations

import torch

from .ratio import LOG_RATIO_CLAMP

__all__ = ["truncated_is_weights"]


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """``min(exp(old_logprobs - rollout_logprobs), cap)``, detached, ``[B, T]``.

    Inputs must already be free of NaN/inf at masked positions (the policy loss does that).
    """
    if not cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {cap}")
    log_w = (old_logprobs.detach() - rollout_logprobs.detach()).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    return torch.exp(log_w).clamp(max=cap)
