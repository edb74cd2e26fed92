"""Checks at the engine's public boundary: a bad batch fails before any compute, naming the problem.

All checks of one batch cost a few reductions and a single host sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from tensordict import TensorDict

from microrl.engine.vision_layout import from_plain_tensors

__all__ = ["check_batch"]

# Per-token float inputs of the built-in losses: checked for shape, dtype and finiteness on loss
# tokens whenever present (a loss may be called with validate=False after this check).
FLOAT_KEYS = (
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
    "advantages",
    "old_values",
    "returns",
)
# Token-aligned keys that are always [B, T] when present.
TOKEN_KEYS = ("attention_mask", "position_ids", "loss_mask")
# The per-row key the micro-batch planner reads: rows with the same id share a micro-batch.
GROUP_KEY = "group"


def check_batch(
    batch: TensorDict | Mapping[str, torch.Tensor],
    *,
    required: Iterable[str],
    vocab_size: int,
    device: torch.device,
    row_keys: Iterable[str] = (),
) -> TensorDict:
    """Validate a ``[B, T]`` batch (docs/batch.md) and return it as a TensorDict on ``device``.

    Checks (on real tokens): ``input_ids`` int64 in ``[0, vocab)``, one contiguous non-empty span
    per row, ``position_ids = cumsum(attention_mask) - 1``; the ``required`` keys ``[B, T]``
    (``row_keys`` and an integer ``group``: ``[B]``); float inputs finite on loss tokens;
    ``loss_mask`` only where a prediction exists. ``attention_mask`` defaults to all ones.
    """
    if not isinstance(batch, (Mapping, TensorDict)):
        raise TypeError(f"batch must be a TensorDict [B], got {type(batch).__name__}")
    if "input_ids" not in batch:
        raise ValueError("batch is missing 'input_ids'")
    if not isinstance(batch, TensorDict):
        batch = from_plain_tensors(dict(batch), batch["input_ids"].shape[0])
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got {tuple(ids.shape)}")
    if ids.dtype != torch.int64:
        raise ValueError(f"input_ids must be int64, got {ids.dtype}")
    if len(batch.batch_size) != 1:
        batch = batch.clone(recurse=False)
        batch.batch_size = batch.batch_size[:1]
    shape = tuple(ids.shape)
    required, row_keys = tuple(required), tuple(row_keys)
    missing = [key for key in required if key not in batch]
    if missing:
        raise ValueError(f"batch is missing required key(s) {missing}")
    for key, value in batch.items():
        if key == GROUP_KEY and (
            value.dtype == torch.bool
            or value.is_floating_point()
            or value.is_complex()
            or tuple(value.shape) != shape[:1]
        ):
            raise ValueError(
                f"'group' must be an integer tensor [B] = {shape[:1]} (rows with the same id are "
                f"kept in one micro-batch), got {value.dtype} {tuple(value.shape)}"
            )
        if key in row_keys:
            if tuple(value.shape) != shape[:1]:
                raise ValueError(
                    f"{key!r} must be a per-row tensor [B] = {shape[:1]}, got {tuple(value.shape)}"
                )
            continue
        per_token = key in FLOAT_KEYS or key in required or key in TOKEN_KEYS
        if per_token and tuple(value.shape) != shape:
            raise ValueError(
                f"{key!r} must have the shape of input_ids {shape}, got {tuple(value.shape)}"
            )
        if key in FLOAT_KEYS and not value.is_floating_point():
            raise ValueError(f"{key!r} must be a floating-point tensor, got {value.dtype}")
        if key == "temperature" and (
            not value.is_floating_point() or tuple(value.shape) not in (shape, shape[:1])
        ):
            raise ValueError(
                f"'temperature' must be a float tensor [B] or [B, T] = {shape}, got "
                f"{value.dtype} {tuple(value.shape)}"
            )
    # A shallow copy: the caller's TensorDict is never modified (even when already on `device`).
    batch = batch.to(device).clone(recurse=False)
    if "attention_mask" not in batch:
        batch["attention_mask"] = torch.ones(shape, dtype=torch.bool, device=device)
    mask = batch["attention_mask"]
    if mask.is_floating_point() and not ((mask == 0) | (mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 and 1")
    mask = mask.to(torch.bool)
    batch["attention_mask"] = mask
    _check_values(batch, mask, vocab_size)
    return batch


def _check_values(batch: TensorDict, mask: torch.Tensor, vocab_size: int) -> None:
    ids = batch["input_ids"]
    real_ids = torch.where(mask, ids, torch.zeros((), dtype=ids.dtype, device=ids.device))
    # A contiguous span has at most one 0->1 and one 1->0 step per row (edges counted as steps).
    steps = (mask[:, 1:] != mask[:, :-1]).sum(dim=1) + mask[:, 0].long() + mask[:, -1].long()
    # "Has a prediction": a real token whose predecessor is real.
    predicted = torch.zeros_like(mask)
    predicted[:, 1:] = mask[:, 1:] & mask[:, :-1]
    checks = [
        (
            (real_ids < 0) | (real_ids >= vocab_size),
            f"input_ids holds token id(s) outside the vocabulary [0, {vocab_size}) on real tokens",
        ),
        (mask.sum(dim=1) == 0, "attention_mask has a row without any real token"),
        (
            steps > 2,
            "attention_mask must mark one contiguous span of real tokens per row "
            "(padding on the left, the right, or both)",
        ),
    ]
    if "position_ids" in batch:
        positions = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
        checks.append(
            (
                mask & (batch["position_ids"] != positions),
                "position_ids must equal cumsum(attention_mask) - 1 on real tokens",
            )
        )
    if "temperature" in batch:
        temp = batch["temperature"]
        used = predicted if temp.dim() == 2 else torch.ones_like(temp, dtype=torch.bool)
        checks.append(
            (used & ~(torch.isfinite(temp) & (temp > 0)), "temperature must be finite and > 0")
        )
    if "loss_mask" in batch:
        loss_mask = batch["loss_mask"]
        if loss_mask.is_floating_point():
            checks.append(((loss_mask != 0) & (loss_mask != 1), "loss_mask must hold only 0 and 1"))
        checks.append(
            (
                loss_mask.to(torch.bool) & ~predicted,
                "loss_mask marks a position with no prediction (padding or the first real token "
                "of a row); per-token tensors are token-aligned: logprobs[b, t] = "
                "log p(input_ids[b, t] | input_ids[b, :t])",
            )
        )
        for key in FLOAT_KEYS:
            if key in batch:
                checks.append(
                    (
                        loss_mask.to(torch.bool) & ~torch.isfinite(batch[key]),
                        f"{key!r} is not finite on a loss_mask token",
                    )
                )
    bad = torch.stack([flag.any() for flag, _ in checks]).tolist()  # the one host sync
    for failed, (flag, message) in zip(bad, checks, strict=True):
        if failed:
            where = flag.nonzero()[0].tolist()
            raise ValueError(f"{message} (first at [b, t] = {where})")
