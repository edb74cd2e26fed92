"""Importance ratios shared by the policy losses, and what every surrogate returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LOG_RATIO_CLAMP",
    "SurrogateOutput",
    "clamped_log_ratio",
    "importance_ratio",
    "sequence_log_ratio",
]

# log(pi / pi_old) is clamped to [-20, 20] before ``exp``. exp(20) ~ 4.9e8 is finite in float32 and
# bfloat16 (max ~3.4e38), and a ratio that far from 1 is clipped by every surrogate anyway, so the
# clamp changes no loss value that matters while keeping inf (and then 0 * inf = NaN in the
# backward pass) out of the graph when a token's log-prob collapses.
LOG_RATIO_CLAMP = 20.0


def clamped_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """``clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)``, ``[B, T]``."""
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``[B, 1]`` length-normalised sequence log-ratio ``mean_{t in mask} clamped log(pi/pi_old)``
    (GSPO's ``log s_i``), with gradient into every loss token of the row.

    ``mask`` is ``[B, T]`` bool; masked positions are removed with ``torch.where`` first. A row
    without loss tokens gets 0. A row is never split across micro-batches, so this is exact.
    """
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(mask, clamped_log_ratio(logprobs, old_logprobs), zero)
    n_tokens = mask.sum(dim=1, keepdim=True).clamp_min(1)
    return log_ratio.sum(dim=1, keepdim=True) / n_tokens  # in the clamp range


def importance_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    sequence_level: bool = False,
) -> torch.Tensor:
    """``[B, T]`` importance ratio ``pi / pi_old``, *not* detached and not clipped.

    Per token ``exp(clamped log(pi/pi_old))``, or with ``sequence_level`` the row's
    ``exp(sequence_log_ratio)`` on each of its tokens (GSPO's ``s_i``; its gradient reaches every
    loss token of the row). Masked positions hold 1 and get no gradient. ``mask`` is ``[B, T]``
    bool; ``old_logprobs`` should be detached (its gradient is not meant to be used).
    """
    if sequence_level:
        log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask).expand_as(logprobs)
    else:
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        log_ratio = torch.where(mask, clamped_log_ratio(logprobs, old_logprobs), zero)
    one = torch.ones((), dtype=logprobs.dtype, device=logprobs.device)
    return torch.where(mask, torch.exp(log_ratio), one)


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
