"""Token alignment (docs/batch.md) of a compact right-padded ``[b, L]`` micro-batch.

The model predicts token ``j + 1`` from position ``j``; the public layout stores that prediction at
column ``j + 1`` (``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``), with 0 where no
prediction exists (a row's first token, padding). Both shifts live here and nowhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from microrl.kernels import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "next_token_targets", "predicting_temperature", "to_token_alignment"]


def next_token_targets(
    input_ids: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``targets[b, j] = input_ids[b, j + 1]`` where that token is real, else ``IGNORE_INDEX``.

    Returns ``(targets, has_next)``, both ``[b, L]``, aligned to the predicting position.
    """
    has_next = F.pad(valid[:, 1:], (0, 1), value=False)
    targets = torch.where(has_next, F.pad(input_ids[:, 1:], (0, 1)), IGNORE_INDEX)
    return targets, has_next


def to_token_alignment(value: torch.Tensor, has_next: torch.Tensor) -> torch.Tensor:
    """Per-predicting-position ``[b, L]`` values -> token-aligned ``[b, L]``, 0 where undefined.

    Masked entries are removed with ``torch.where`` (not multiplied), so whatever the head left
    there (even NaN) reaches neither the output nor a gradient.
    """
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    return F.pad(torch.where(has_next, value, zero)[:, :-1], (1, 0))


def predicting_temperature(temperature: torch.Tensor, has_next: torch.Tensor) -> torch.Tensor:
    """A batch's ``temperature`` (``[b]`` per row, or token-aligned ``[b, L]``: the temperature
    token ``t`` was sampled at) -> ``[b, L]`` at the predicting positions (1 where none)."""
    if temperature.dim() == 1:
        temperature = temperature.unsqueeze(1).expand_as(has_next)
    else:
        temperature = F.pad(temperature[:, 1:], (0, 1))
    one = torch.ones((), dtype=temperature.dtype, device=temperature.device)
    return torch.where(has_next, temperature, one)
