"""A role's outputs and its loss's result at the loop's boundary (see docs/engine.md).

A role's ``_model_forward`` returns per-position ``[b, L]`` tensors (aligned to the *predicting*
position, or packed ``[1, N]``) and/or per-row ``[b]`` tensors; :func:`align_outputs` brings the
former to token alignment and leaves the latter in row order. :func:`check_loss_result` checks
what a ``loss_fn`` returned, at the boundary, instead of failing later inside backward or the
metric reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from microrl.engine.alignment import to_token_alignment
from microrl.losses.metrics import Metric

__all__ = ["align_outputs", "check_loss_result", "last_token_index"]


def last_token_index(valid: torch.Tensor, *, packed: bool) -> torch.Tensor:
    """``[b]`` flat index of each sequence's last real token in ``input_ids.flatten()`` of a
    compact right-padded ``[b, L]`` micro-batch (``row * L + length - 1``), or of its packed
    ``[1, N]`` row (``cumsum(lengths) - 1``). Computed on the device from the mask: no host sync.
    """
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
    are. float32 for the loss (bf16 under autocast is too coarse); float64 stays float64 so
    exactness tests compare at fp64 precision. Any other shape is a ValueError naming the key."""
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
