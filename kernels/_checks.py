"""The public boundary of the fused lm head: its non-tensor arguments bundled (:class:`HeadSpec`),
their validation, the flattened tensors every implementation starts from, and the dtype rules.

Every public function (the fused kernel, its eager reference, the fused loss and the two
vocab-parallel ones) checks its arguments here once, raising the same errors for the same bad
input, naming the argument, so a caller can switch between them (``use_fused_kernel``) without
changing behaviour; past the check the implementations take the checked :class:`HeadSpec`
instead of its keywords. All compute in the same dtype (:func:`compute_dtype`) with autocast
off (:func:`no_autocast`). The contract is in ``docs/kernels.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, NamedTuple, TypedDict

import torch

__all__ = [
    "IGNORE_INDEX",
    "IMPLEMENTATIONS",
    "HeadInputs",
    "HeadOptions",
    "HeadSpec",
    "check_implementation",
    "check_linear_logprob_inputs",
    "checked_inputs",
    "compute_dtype",
    "flatten",
    "head_dtype",
    "head_spec",
    "no_autocast",
]

#: The default ``ignore_index``: the target id of a position with no prediction (the engine's
#: next-token targets and the sequence-parallel padding use it too).
IGNORE_INDEX = -100

#: The values of the ``implementation`` argument of the fused functions.
IMPLEMENTATIONS = ("auto", "tiles", "triton", "chunks")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The fused head's non-tensor arguments, as the public functions take them; bundled so the
    implementations (and their autograd Functions, whose backward returns a None per argument)
    take one checked object instead of re-listing the keywords. A per-token temperature is a tensor and
    travels beside it (``HeadInputs.inv_t``); ``temperature`` is then 1.

    Built unchecked by :func:`head_spec` from a public function's keywords;
    :func:`check_linear_logprob_inputs` returns it checked, numbers as Python floats;
    :func:`~microrl.kernels._dispatch.resolve` replaces ``"auto"`` by the implementation that
    runs."""

    with_entropy: bool = True
    chunk_size: int | None = None
    ignore_index: int = IGNORE_INDEX
    validate: bool = True
    logit_scale: float = 1.0
    softcap: float | None = None
    implementation: str = "auto"
    temperature: float = 1.0  # a scalar temperature; 1.0 with a per-token tensor

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature


class HeadOptions(TypedDict, total=False):
    """The keywords the five public functions share, typed once for their ``**head`` (PEP 692:
    type checkers and IDEs list them). Documented in
    :func:`~microrl.kernels.fused_linear_logprob`; defaults: ``temperature=1.0``, ``bias=None``,
    the others :class:`HeadSpec`'s (``with_entropy`` is False for the fused losses)."""

    temperature: float | torch.Tensor
    with_entropy: bool
    chunk_size: int | None
    ignore_index: int
    validate: bool
    bias: torch.Tensor | None
    logit_scale: float
    softcap: float | None
    implementation: str


def head_spec(
    function: str, head: HeadOptions, *, with_entropy: bool = True
) -> tuple[HeadSpec, Any, Any]:
    """``(spec unchecked, temperature, bias)`` of a public ``function``'s ``**head`` keywords;
    an unknown keyword is the TypeError Python raises for one. ``with_entropy``: its default."""
    unknown = sorted(head.keys() - HeadOptions.__annotations__.keys())
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    options: dict[str, Any] = {"with_entropy": with_entropy, **head}
    temperature, bias = options.pop("temperature", 1.0), options.pop("bias", None)
    return HeadSpec(**options), temperature, bias


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype the lm-head is computed in: float64 if any input is float64 (so ``gradcheck``
    works), float32 otherwise, so 16-bit inputs are upcast and the logits are never rounded to 16
    bits. A float32/float64 mix is upcast to float64 rather than refused: the upcast is exact, and it
    is the same "widest input, at least float32" rule as for a 16/32-bit mix."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def head_dtype(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.dtype:
    """:func:`compute_dtype` of a head's inputs (the bias counts as one)."""
    return compute_dtype(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,)))


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off: under ``torch.autocast`` the head's matmuls would otherwise run (and round
    the logits) in the autocast dtype; its contract is the float32 (float64) head whatever the
    context."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def check_implementation(implementation) -> str:
    """``implementation`` itself when it is one of :data:`IMPLEMENTATIONS`, else ValueError."""
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))}, got "
            f"{implementation!r}"
        )
    return implementation


def check_linear_logprob_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    bias: torch.Tensor | None,
    spec: HeadSpec,
    *,
    values: bool | None = None,
) -> tuple[HeadSpec, torch.Tensor | None, int | None]:
    """Validate the arguments of a fused-head call; return ``(spec, per_token, count)``.

    ``spec`` comes back checked, its numbers as Python floats and ``spec.temperature`` the
    scalar temperature; ``per_token`` is None for a scalar temperature, or the temperature tensor
    in the compute dtype broadcast to ``targets.shape`` (``spec.temperature`` is then 1).

    ``values`` (default ``spec.validate``) also checks the values on the device (targets in
    range, tensor temperatures finite and > 0) and returns ``count``, the number of non-ignored
    targets, all read back in ONE host sync (the caller needs the count anyway to compact the
    rows without another one). Without it nothing is read from the device (no host sync inside
    the engine's micro-batch loop, docs/engine.md "Host syncs"): values are trusted, a 0-dim
    temperature tensor stays a (broadcast) tensor and ``count`` is None; for callers that
    validated the values already, or check them their own way (vocab-parallel).

    ``bias`` (``[V]``, float, on ``hidden``'s device) joins the compute dtype like the other
    inputs; ``logit_scale`` must be a finite number > 0 and ``softcap`` None or one.
    """
    check_implementation(spec.implementation)
    with_entropy, chunk_size, validate = spec.with_entropy, spec.chunk_size, spec.validate
    ignore_index, logit_scale, softcap = spec.ignore_index, spec.logit_scale, spec.softcap
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
    cdtype = head_dtype(hidden, weight, bias)
    temp = _check_temperature(temperature, targets, cdtype, hidden.device)
    spec = dataclasses.replace(
        spec,
        logit_scale=float(logit_scale),
        softcap=None if softcap is None else float(softcap),
        temperature=1.0 if isinstance(temp, torch.Tensor) else temp,
    )
    if not (validate if values is None else values):
        if isinstance(temp, torch.Tensor) and temp.dim() == 0:  # its value would need a sync
            temp = torch.broadcast_to(temp.to(device=hidden.device, dtype=cdtype), targets.shape)
        return spec, _per_token(temp), None
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
            spec = dataclasses.replace(spec, temperature=temp)
        elif summary[2]:
            raise ValueError("temperature must be finite and > 0 everywhere")
    return spec, _per_token(temp), int(summary[1])


def _per_token(temp: float | torch.Tensor) -> torch.Tensor | None:
    return temp if isinstance(temp, torch.Tensor) else None


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


class HeadInputs(NamedTuple):
    """A call's tensors as the implementations take them, flattened by the public function
    (under autograd, so its Function receives tensors still connected to the graph), and which
    of them get a gradient."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]; vocab-parallel: this rank's shard
    bias: torch.Tensor | None  # [V] (the shard's) or None
    targets: torch.Tensor  # [N] int64, ignored positions 0
    valid: torch.Tensor  # [N] bool, False at ignored positions
    inv_t: torch.Tensor | None  # [N] 1 / the per-token temperature; None: spec.temperature
    count: int | None  # non-ignored rows, read in validation's one sync; None without it
    need: tuple[bool, bool, bool]  # a gradient to hidden, weight, bias

    def masked_inv_t(self) -> torch.Tensor | None:
        """``inv_t`` with 1 at ignored positions: their temperature is not validated, never used."""
        return None if self.inv_t is None else torch.where(self.valid, self.inv_t, 1.0)

    def rows(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(rows_idx, row_mask, inv_t)`` of the log-prob kernels. With the count, the
        non-ignored rows compacted without another sync: ``rows_idx`` ``[M]``, or None when no
        row is ignored (every row, in order). Without it (no sync), every row: the ignored ones
        masked (``row_mask``, ``masked_inv_t``)."""
        if self.count is None:
            return None, self.valid, self.masked_inv_t()
        if self.count < self.valid.numel():
            return torch.nonzero_static(self.valid, size=self.count).squeeze(1), None, self.inv_t
        return None, None, self.inv_t


def checked_inputs(
    hidden, weight, targets, temperature, bias, spec: HeadSpec
) -> tuple[HeadSpec, HeadInputs]:
    """A single-device call's checks and flattening: ``(checked spec, inputs)``; the arguments
    as :func:`check_linear_logprob_inputs` takes them."""
    spec, per_token, count = check_linear_logprob_inputs(
        hidden, weight, targets, temperature, bias, spec
    )
    return spec, flatten(hidden, weight, bias, targets, per_token, spec, count)


def flatten(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    per_token: torch.Tensor | None,
    spec: HeadSpec,
    count: int | None,
) -> HeadInputs:
    """The checked inputs of a call as :class:`HeadInputs` (``per_token`` and ``count`` as
    :func:`check_linear_logprob_inputs` returns them)."""
    wide = targets.reshape(-1).long()  # compared as int64: in uint8, -100 would equal 156
    valid = wide != spec.ignore_index
    inv_t = None if per_token is None else (1.0 / per_token).reshape(-1)
    on = torch.is_grad_enabled()
    need = tuple(on and t is not None and t.requires_grad for t in (hidden, weight, bias))
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    return HeadInputs(
        hidden_2d, weight, bias, torch.where(valid, wide, 0), valid, inv_t, count, need
    )
