"""Plain policy gradient (REINFORCE, Williams 1992): ``l_t = -A_t * log pi(y_t)``.

No importance correction: exact on-policy, an approximation otherwise. The ratio to the
behaviour policy is still computed for the ``ratio_min/max`` and ``ppo_kl`` metrics (they tell
how off-policy the data was); nothing is clipped.
"""

from __future__ import annotations

import torch

from .config import PolicyLossConfig
from .ratio import SurrogateOutput, clamped_log_ratio

__all__ = ["reinforce_surrogate"]


def reinforce_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: PolicyLossConfig,
) -> SurrogateOutput:
    """Per-token REINFORCE loss. All inputs ``[B, T]``, already free of masked NaN/inf."""
    del config  # no hyper-parameters: the signature is the registry's
    log_ratio = clamped_log_ratio(logprobs, old_logprobs).detach()
    never = torch.zeros_like(mask)
    return SurrogateOutput(-advantages * logprobs, torch.exp(log_ratio), log_ratio, never, never)
