"""Importance ratios shared by the policy losses, and what every surrogate returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LOG_RATIO_CLAMP", "SurrogateOutput", "clamped_log_ratio"]

# log(pi / pi_old) is clamped to [-20, 20] before ``exp``. exp(20) ~ 4.9e8 is finite in float32 and
# bfloat16 (max ~3.4e38), and a ratio that far from 1 is clipped by every surrogate anyway, so the
# clamp changes no loss value that matters while keeping inf (and then 0 * inf = NaN in the
# backward pass) out of the graph when a token's log-prob collapses.
LOG_RATIO_CLAMP = 20.0


def clamped_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)``, ``[B, T]``."""
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@dataclass(frozen=True)
class SurrogateOutput:
    """Per-token result of one policy surrogate (all ``[B, T]``; masked positions are finite).

    Attributes:
        loss: the per-token policy-gradient loss (to be aggregated), with gradient.
        ratio: the importance ratio the surrogate used (detached), for ``ratio_min/max``.
        log_ratio: ``log(pi / pi_old)`` per token (detached), for ``ppo_kl``.
        clipped_lower: bool, where a lower clip binds (it changes the gradient) for that token.
        clipped_upper: bool, where an upper clip binds for that token.
        clipped_dual: bool, where the dual clip binds, or ``None`` when the loss has none.
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    clipped_lower: torch.Tensor
    clipped_upper: torch.Tensor
    clipped_dual: torch.Tensor | None = None
