"""A role's outputs, its loss's result and a step's result at the loop's boundary (docs/engine.md).

:func:`check_loss_result` and :func:`check_step_result` check what a ``loss_fn`` and a
``forward_step`` override returned, instead of failing later inside backward or the reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from tensordict import TensorDict

from microrl.engine.alignment import to_token_alignment
from microrl.losses.metrics import Metric

__all__ = [
    "FUSED_LOSS_KEY",
    "StepResult",
    "align_outputs",
    "check_loss_result",
    "check_step_result",
    "last_token_index",
    "split_fused_loss",
]

#: The key under which ``_model_forward`` returns the micro-batch's loss on the fused loss path.
FUSED_LOSS_KEY = "loss"


class StepResult(NamedTuple):
    """What ``Engine.forward_step`` returns for one micro-batch: ``loss`` a 0-d tensor *with*
    its graph (the caller runs ``backward``) or None without the loss's inputs; ``output`` the
    detached, token-aligned outputs; ``metrics`` the loss's detached ``Metric`` values."""

    loss: torch.Tensor | None
    output: TensorDict
    metrics: dict[str, Metric]


def last_token_index(valid: torch.Tensor, *, packed: bool) -> torch.Tensor:
    """``[b]`` flat index of each sequence's last real token in ``input_ids.flatten()`` of a
    compact ``[b, L]`` micro-batch (``row * L + length - 1``), or of its packed ``[1, N]`` row
    (``cumsum(lengths) - 1``); from the mask, no host sync."""
    ends = valid.sum(dim=1)
    if packed:
        return ends.cumsum(0) - 1
    rows = torch.arange(valid.shape[0], device=valid.device)
    return rows * valid.shape[1] + ends - 1


def align_outputs(
    raw: Mapping[str, torch.Tensor],
    num_rows: int,
    position_shape: tuple[int, ...],
    has_next: torch.Tensor,
    unpack: Callable[[torch.Tensor], torch.Tensor] | None,
    role: str,
) -> dict[str, torch.Tensor]:
    """Per-position outputs (``position_shape``: that of the ids the module saw) -> token-aligned
    ``[b, L]`` (unpacked first when ``unpack`` is given); per-row ``[num_rows]`` outputs as they
    are; float32 (float64 stays). Any other shape is a ValueError naming the key."""
    aligned = {}
    for key, value in raw.items():
        value = value if value.dtype == torch.float64 else value.float()
        if value.dim() == 1 and value.shape[0] == num_rows:
            aligned[key] = value  # per-row: one value per sequence, in row order
            continue
        if tuple(value.shape) != position_shape:
            raise ValueError(
                f"{role}._model_forward output {key!r} has shape {tuple(value.shape)}: expected "
                f"per-position {position_shape} (the shape of its input_ids) or per-row "
                f"[{num_rows}]"
            )
        if unpack is not None:
            value = unpack(value)
        aligned[key] = to_token_alignment(value, has_next)
    return aligned


def check_loss_result(result: object) -> tuple[torch.Tensor, dict[str, Metric]]:
    """A loss_fn must return ``(0-d tensor, dict[str, Metric])``: say so at the boundary instead of
    failing later inside backward or the metric reduction. Metric values come back detached."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"loss_fn must return (loss, metrics), got {type(result).__name__}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"loss_fn's loss must be a 0-d tensor, got {getattr(loss, 'shape', type(loss))}"
        )
    if not isinstance(metrics, Mapping) or not all(isinstance(m, Metric) for m in metrics.values()):
        raise TypeError(
            "loss_fn's metrics must be a dict[str, Metric] (wrap values as "
            "microrl.losses.Metric(tensor.detach()))"
        )
    # Detached here: a metric still holding its graph would pin every micro-batch's activations
    # until the end of the mini-batch (the list of metrics lives that long).
    return loss, {k: Metric(m.value.detach(), m.reduce) for k, m in metrics.items()}


def split_fused_loss(
    raw: Mapping[str, torch.Tensor], role: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A fused-loss ``_model_forward``'s result -> ``(outputs to align, the micro-batch's loss)``,
    the loss taken from under :data:`FUSED_LOSS_KEY`; a ``TypeError`` naming the role without it."""
    outputs = dict(raw)
    loss = outputs.pop(FUSED_LOSS_KEY, None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        found = "nothing" if loss is None else getattr(loss, "shape", type(loss).__name__)
        raise TypeError(
            f"{role}._model_forward got a group_loss (its fuses_loss is True) and must return "
            f"the micro-batch's loss as a 0-d tensor under {FUSED_LOSS_KEY!r}, got {found}"
        )
    return outputs, loss


def check_step_result(result: object, role: str) -> StepResult:
    """What a ``forward_step`` (an override's too) returned, as a :class:`StepResult`; a
    ``TypeError`` naming the role and what was expected otherwise."""
    expected = "StepResult(loss, output, metrics)"
    if not (isinstance(result, tuple) and len(result) == 3):
        size = f" of {len(result)}" if isinstance(result, tuple) else ""
        raise TypeError(
            f"{role}.forward_step must return {expected} (a 0-d tensor or None, a TensorDict, "
            f"a dict[str, Metric]), got a {type(result).__name__}{size}"
        )
    loss, output, metrics = result
    if loss is not None and not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        found = getattr(loss, "shape", type(loss).__name__)
        raise TypeError(f"{role}.forward_step's loss must be a 0-d tensor or None, got {found}")
    if not isinstance(output, TensorDict):
        raise TypeError(
            f"{role}.forward_step's output must be a TensorDict, got {type(output).__name__}"
        )
    if not isinstance(metrics, Mapping) or not all(isinstance(m, Metric) for m in metrics.values()):
        raise TypeError(
            f"{role}.forward_step's metrics must be a dict[str, Metric], got "
            f"{type(metrics).__name__}"
        )
    return StepResult(loss, output, dict(metrics))
