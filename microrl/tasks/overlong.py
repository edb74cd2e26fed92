"""DAPO's soft overlong punishment: a reward term that falls linearly over the last tokens of the
response budget (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", arXiv 2503.14476, eq. 13; docs/tasks.md#overlong-penalty).

The recipes add it to each row's reward after scoring (``task.rewards.overlong_buffer``,
``task.rewards.overlong_penalty``); the held-out accuracy keeps the task's own score.
"""

from __future__ import annotations

import math

import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(
    lengths: torch.Tensor,
    max_new_tokens: int,
    buffer: int,
    penalty: float = 1.0,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The overlong reward term of each row, from its response length ``|y|`` (``lengths`` [B]).

    With ``L_max = max_new_tokens``, ``L_cache = buffer`` and ``p = penalty``::

        0                                        |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache * p  L_max - L_cache < |y| <= L_max
        -p                                       |y| > L_max

    so 0 up to ``L_max - L_cache`` tokens, then down by ``p / L_cache`` per token to ``-p`` at
    ``L_max`` (DAPO's third case cannot occur in a rollout: generation stops at ``L_max``). The
    recipes count ``|y|`` as the row's ``loss_mask`` tokens: the response with its ``<eos>``,
    so a response cut at ``max_new_tokens`` and one whose ``<eos>`` is its ``L_max``-th token
    both get ``-p``. ``buffer=0`` is off: all zeros.

    Computed in float64, returned as ``dtype`` (float32: the recipes' rewards) on ``lengths``'
    device. ``ValueError`` for lengths that are not a 1-D real tensor, ``max_new_tokens < 1``,
    ``buffer`` outside ``[0, max_new_tokens)``, or a ``penalty`` that is negative or not finite.
    """
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.is_complex():
        raise ValueError(
            f"lengths must be a [B] tensor, got {getattr(lengths, 'shape', lengths)!r}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(buffer, int) or not 0 <= buffer < max_new_tokens:
        raise ValueError(
            f"overlong_buffer must be an int in [0, max_new_tokens={max_new_tokens}), got "
            f"{buffer!r}"
        )
    if not (math.isfinite(penalty) and penalty >= 0):
        raise ValueError(f"overlong_penalty must be a finite float >= 0, got {penalty!r}")
    length = lengths.to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=length.device)
    if buffer == 0:
        return torch.zeros_like(length, dtype=dtype)
    start = float(max_new_tokens - buffer)
    ramp = (start - length) / buffer * penalty
    value = torch.where(length <= start, zero, ramp)
    value = torch.where(length > max_new_tokens, zero - penalty, value)
    return value.to(dtype)
