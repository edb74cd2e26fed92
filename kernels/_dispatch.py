"""Which implementation of the fused lm head runs: the dispatch rule, a forcing switch, and a
record of what ran.

Three implementations compute the same function (docs/kernels.md, "Implementations"):

* ``"tiles"``: vocabulary tiles sized for CPU caches and OpenMP regions
  (``kernels/linear_logprob.py``), the fastest on CPUs;
* ``"triton"``: full-vocabulary-wide row blocks sized for a GPU, one cuBLAS GEMM per tile into
  float32 logits and two Triton row kernels (``kernels/chunked.py``, ``kernels/_triton_rows.py``);
* ``"chunks"``: the same GPU algorithm with its two row kernels written as torch ops
  (``kernels/_row_ops.py``): CUDA without Triton, float64 on CUDA, and the tests on CPUs.

The rule (``implementation="auto"``): CUDA tensors take ``"triton"`` when Triton imports and has
a GPU driver (else ``"chunks"``, with one warning), float64 on CUDA takes ``"chunks"`` (the Triton
kernels compute in float32); everything else takes ``"tiles"``. Triton is imported only for CUDA tensors or when asked
for by name, never on the CPU path.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from types import ModuleType

import torch

from ._checks import IMPLEMENTATIONS, HeadSpec, check_implementation, head_dtype

__all__ = ["IMPLEMENTATIONS", "head_implementation", "last_implementation", "resolve"]

logger = logging.getLogger("microrl.kernels")

_LAST: list[str | None] = [None]
# None: not tried yet; else whether the Triton row kernels import and Triton has a GPU driver.
_TRITON_OK: list[bool | None] = [None]


def _triton_usable() -> bool:
    """Whether the Triton row kernels import and Triton has an active GPU driver (tried once per
    process, only for CUDA tensors). A machine that reports CUDA tensors without one (a simulated
    GPU in the tests) runs the torch row ops instead, with one warning."""
    if _TRITON_OK[0] is None:
        try:
            importlib.import_module(f"{__package__}._triton_rows")
            from triton.runtime import driver

            driver.active.get_current_target()
            _TRITON_OK[0] = True
        except Exception as error:
            _TRITON_OK[0] = False
            warnings.warn(
                f"Triton is not usable here ({error}): the fused lm head runs its GPU path with "
                "torch row ops instead (slower; pip install 'microrl[cuda]')",
                RuntimeWarning,
                stacklevel=3,
            )
    return _TRITON_OK[0]


def head_implementation(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    implementation: str = "auto",
) -> str:
    """The implementation a fused lm-head call on these tensors runs: ``"tiles"``, ``"triton"``
    or ``"chunks"`` (the module docstring gives the rule). A name other than ``"auto"`` is
    returned as it is (after validation): the forcing switch."""
    check_implementation(implementation)
    if implementation != "auto":
        return implementation
    if not hidden.is_cuda:
        return "tiles"
    if head_dtype(hidden, weight, bias) == torch.float64:
        return "chunks"
    return "triton" if _triton_usable() else "chunks"


def resolve(
    hidden: torch.Tensor, weight: torch.Tensor, bias, spec: HeadSpec, what: str
) -> HeadSpec:
    """``spec`` with the implementation this call of ``what`` (a public function's name) runs,
    recorded for :func:`last_implementation`."""
    name = head_implementation(hidden, weight, bias, spec.implementation)
    record(name, hidden, what)
    return spec if name == spec.implementation else dataclasses.replace(spec, implementation=name)


def row_ops(name: str) -> ModuleType:
    """The row kernels of a chunked implementation: the Triton module or its torch twin."""
    if name == "triton":
        return importlib.import_module(f"{__package__}._triton_rows")
    return importlib.import_module(f"{__package__}._row_ops")


def record(name: str, hidden: torch.Tensor, what: str) -> None:
    """Remember (and debug-log) the implementation a call runs, for :func:`last_implementation`;
    not while torch.compile traces the call (a logger call would break its graph)."""
    if torch.compiler.is_compiling():
        return
    _LAST[0] = name
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: %s implementation (%s, %s)", what, name, hidden.device, hidden.dtype)


def last_implementation() -> str | None:
    """The implementation the last fused lm-head call of this process ran (``"tiles"``,
    ``"triton"`` or ``"chunks"``; None before the first call): what the GPU check asserts, so a
    fast path that is silently not taken fails it."""
    return _LAST[0]
