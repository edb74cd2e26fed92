"""PPO clipped surrogate with asymmetric (DAPO) and dual clip; also the GRPO surrogate.

Per token, with ``r = pi / pi_old`` and advantage ``A`` (Schulman et al. 2017)::

    l = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))

``eps_low != eps_high`` is DAPO's "clip-higher" (Yu et al. 2025). The dual clip (Ye et al. 2020)
bounds the loss of negative-advantage tokens whose ratio exploded: for ``A < 0``,
``l = min(l, -A * c)`` with ``c = clip_ratio_c > 1``.

GRPO (Shao et al. 2024) is this surrogate on group-normalised advantages
(:func:`microrl.losses.grpo_advantages`); its KL term is the policy loss's ``kl_coef``.
"""

from __future__ import annotations

import torch

from .config import PolicyLossConfig
from .ratio import SurrogateOutput, clamped_log_ratio

__all__ = ["ppo_surrogate"]


def ppo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
) -> SurrogateOutput:
    """Per-token clipped surrogate. All inputs ``[B, T]``, already free of masked NaN/inf.

    A clip *binds* where it removes the token's gradient: the upper clip for ``A > 0`` and
    ``r > 1 + eps_high``, the lower clip for ``A < 0`` and ``r < 1 - eps_low``, the dual clip for
    ``A < 0`` and ``r > c``. Ties (``r`` exactly on a bound) do not count.
    """
    log_ratio = clamped_log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    positive, negative = advantages > 0, advantages < 0
    r = ratio.detach()
    clipped_upper = mask & positive & (r > high)
    clipped_lower = mask & negative & (r < low)
    clipped_dual = None
    if config.clip_ratio_c is not None:
        dual = -advantages * config.clip_ratio_c
        loss = torch.where(negative, torch.minimum(loss, dual), loss)
        clipped_dual = mask & negative & (r > config.clip_ratio_c)
    return SurrogateOutput(loss, r, log_ratio.detach(), clipped_lower, clipped_upper, clipped_dual)
