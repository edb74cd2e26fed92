"""GSPO: group sequence policy optimisation (Zheng et al. 2025, "Group Sequence Policy Optimization").

The importance ratio is per *sequence* and length-normalised:
``s_i = exp(mean_{t in loss tokens of i} log(pi / pi_old))``. We use the paper's token-level
form (GSPO-token), whose value per token equals ``s_i`` but whose gradient flows through each
token's own log-prob::

    s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]
    l_{i,t} = max(-A_{i,t} * s_{i,t}, -A_{i,t} * clip(s_{i,t}, 1 - eps_low, 1 + eps_high))

With a per-sequence advantage and ``loss_agg_mode='seq-mean-token-mean'`` this is exactly the
sequence-level GSPO objective. The paper's clip ranges are far narrower than PPO's
(``eps_low=3e-4``, ``eps_high=4e-4``): set them in the config. No dual clip.
"""

from __future__ import annotations

import torch

from .config import PolicyLossConfig
from .ratio import SurrogateOutput, sequence_log_ratio

__all__ = ["gspo_surrogate"]


def gspo_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
) -> SurrogateOutput:
    """Per-token GSPO-token loss. All inputs ``[B, T]``, already free of masked NaN/inf.

    A row without loss tokens gets ratio 1 (and contributes nothing once aggregated).
    """
    seq_log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask)  # [B, 1], in the clamp range
    # Straight-through: value sg[seq_log_ratio], gradient d logprobs_t (token-level GSPO).
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    low, high = 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(low, high))
    r = ratio.detach()
    clipped_upper = mask & (advantages > 0) & (r > high)
    clipped_lower = mask & (advantages < 0) & (r < low)
    return SurrogateOutput(
        loss, r, seq_log_ratio.detach().expand_as(r), clipped_lower, clipped_upper
    )
