"""CISPO: clipped IS-weight policy optimisation (MiniMax-M1 technical report, 2025).

Instead of clipping the *update* (which drops the gradient of clipped tokens, often the rare
"reflective" tokens), CISPO clips the importance weight and stops its gradient, so every token
keeps a REINFORCE gradient::

    l_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi(y_t)

MiniMax-M1 effectively disables the lower bound (a large ``clip_ratio_low``, e.g. 1e9 gives
``1 - eps_low < 0``) and tunes only ``clip_ratio_high``. A clip binds wherever the weight is cut,
whatever the sign of ``A`` (the weight scales the gradient of both signs).
"""

from __future__ import annotations

import torch

from .config import PolicyLossConfig
from .ratio import SurrogateOutput, clamped_log_ratio

__all__ = ["cispo_surrogate"]


def cispo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
) -> SurrogateOutput:
    """Per-token CISPO loss. All inputs ``[B, T]``, already free of masked NaN/inf."""
    log_ratio = clamped_log_ratio(logprobs, old_logprobs).detach()
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    weight = ratio.clamp(low, high)  # a lower bound <= 0 never binds: ratio > 0
    loss = -weight * advantages * logprobs
    nonzero = advantages != 0
    clipped_upper = mask & nonzero & (ratio > high)
    clipped_lower = mask & nonzero & (ratio < low)
    return SurrogateOutput(loss, ratio, log_ratio, clipped_lower, clipped_upper)
