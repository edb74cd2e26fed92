"""Input validation and dtype rules shared by the fused kernel and its eager reference.

Both entry points raise the same errors for the same bad input, at the public boundary, naming the
argument, so a caller can switch between them (``use_fused_kernel``) without changing behaviour,
and both compute in the same dtype (:func:`compute_dtype`) with autocast off (:func:`no_autocast`).
The contract is in ``docs/kernels.md``.
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = ["IGNORE_INDEX", "check_linear_logprob_inputs", "compute_dtype", "no_autocast"]

#: The default ``ignore_index``: the target id of a position with no prediction (the engine's
#: next-token targets and the sequence-parallel padding use it too).
IGNORE_INDEX = -100

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the lm-head is computed in: float64 if any input is float64 (so ``gradcheck``
    works), float32 otherwise, so 16-bit inputs are upcast and the logits are never rounded to 16
    bits. A float32/float64 mix is upcast to float64 rather than refused: the upcast is exact, and it
    is the same "widest input, at least float32" rule as for a 16/32-bit mix."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off: under ``torch.autocast`` the head's matmuls would otherwise run (and round
    the logits) in the autocast dtype; its contract is the float32 (float64) head whatever the
    context."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def check_linear_logprob_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    with_entropy: bool,
    chunk_size: int | None,
    ignore_index: int,
    validate: bool = True,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[float | torch.Tensor, int | None]:
    """Validate the arguments of ``fused_linear_logprob``; return ``(temperature, count)``.

    ``temperature`` comes back normalised: a Python float for a scalar temperature, or a tensor in
    the compute dtype broadcast to ``targets.shape`` for a per-token / per-row temperature.

    ``validate=True`` also checks the values on the device (targets in range, tensor temperatures
    finite and > 0) and returns ``count``, the number of non-ignored targets, all read back in ONE
    host sync (the caller needs the count anyway to compact the rows without another one).
    ``validate=False`` reads nothing from the device (no host sync inside the engine's micro-batch
    loop, docs/engine.md "Host syncs"): values are trusted, a 0-dim temperature tensor stays a (broadcast) tensor
    and ``count`` is None. Only for callers that validated the values already.

    ``bias`` (``[V]``, float, on ``hidden``'s device) joins the compute dtype like the other
    inputs; ``logit_scale`` must be a finite number > 0 and ``softcap`` None or one.
    """
    for name, tensor in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [..., H] with rank >= 2, got shape {tuple(hidden.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden must be a float tensor, got dtype {hidden.dtype}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight must be a float tensor, got dtype {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H={hidden.shape[-1]} (hidden's last dim), "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight must have at least one vocabulary row")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(
            f"hidden, weight and targets must share a device, got {hidden.device}, "
            f"{weight.device}, {targets.device}"
        )
    if targets.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden shape without its last "
            f"dim {tuple(hidden.shape[:-1])}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if not isinstance(with_entropy, bool):
        raise ValueError(f"with_entropy must be a bool, got {with_entropy!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be a bool, got {validate!r}")
    _check_logit_transform(bias, weight, logit_scale, softcap)
    dtypes = (
        (hidden.dtype, weight.dtype) if bias is None else (hidden.dtype, weight.dtype, bias.dtype)
    )
    cdtype = compute_dtype(*dtypes)
    temp = _check_temperature(temperature, targets, cdtype, hidden.device)
    if not validate:
        if isinstance(temp, torch.Tensor) and temp.dim() == 0:  # its value would need a sync
            temp = torch.broadcast_to(temp.to(device=hidden.device, dtype=cdtype), targets.shape)
        return temp, None
    vocab = weight.shape[0]
    targets = targets.long()  # int8/uint8 comparisons wrap: in uint8 -100 == 156 and 300 == 44
    valid = targets != ignore_index
    out_of_range = ((targets < 0) | (targets >= vocab)) & valid
    probes = [out_of_range.any(), valid.sum()]
    if isinstance(temp, torch.Tensor):
        probes.append(temp if temp.dim() == 0 else (~(torch.isfinite(temp) & (temp > 0))).any())
    # float64 holds the flags, the count (exact below 2**53) and a 0-dim temperature's value.
    probes = [p.to(device=hidden.device, dtype=torch.float64).reshape(()) for p in probes]
    summary = torch.stack(probes).tolist()  # the one host sync
    if summary[0]:
        bad = targets[out_of_range][0].item()  # error path only
        raise ValueError(
            f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}, found {bad}"
        )
    if isinstance(temp, torch.Tensor):
        if temp.dim() == 0:
            temp = _check_temperature(summary[2], targets, cdtype, hidden.device)
        elif summary[2]:
            raise ValueError("temperature must be finite and > 0 everywhere")
    return temp, int(summary[1])


def _check_logit_transform(
    bias: torch.Tensor | None, weight: torch.Tensor, logit_scale: float, softcap: float | None
) -> None:
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"bias must be a float tensor, got dtype {bias.dtype}")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"bias must be [V] with V={weight.shape[0]} (weight's rows), got shape "
                f"{tuple(bias.shape)}"
            )
        if bias.device != weight.device:
            raise ValueError(
                f"bias must be on the weight's device {weight.device}, got {bias.device}"
            )
    for name, value in (("logit_scale", logit_scale), ("softcap", softcap)):
        if value is None and name == "softcap":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite float > 0, got {value!r}")


def _check_temperature(
    temperature: float | torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> float | torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        if temperature.requires_grad:
            # No gradient is defined for the temperature: refuse rather than drop one silently.
            raise ValueError("temperature tensor must not require grad (detach it)")
        if not (temperature.is_floating_point() or temperature.dtype in _INTEGER_DTYPES):
            raise ValueError(f"temperature must be a real tensor, got dtype {temperature.dtype}")
        if temperature.dim() == 0:
            return temperature  # its value is checked (or trusted) by the caller
        try:
            expanded = torch.broadcast_to(temperature, targets.shape)
        except RuntimeError as error:
            raise ValueError(
                f"temperature shape {tuple(temperature.shape)} must broadcast to targets shape "
                f"{tuple(targets.shape)}"
            ) from error
        return expanded.to(device=device, dtype=dtype)  # values: checked (or trusted) by caller
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a float or a tensor, got {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return float(temperature)
