"""Roofline predictions of the fused lm head on an H100 / H200, computed on a CPU.

    python benchmarks/roofline_head.py                  # the issue's shapes, bf16, H100 and H200
    python benchmarks/roofline_head.py --cases 64x32x1000 --json out.json

Each microrl path runs for real, forward + backward of ``sum(g1 * logprobs) + sum(g2 * entropy)``
(gradients to hidden and weight; validated targets, none ignored, as in bench_kernel.py), on
``meta`` tensors (shapes and dtypes, no data), under a
``TorchDispatchMode`` that counts every torch op's FLOPs (``2 M N K`` per matmul) and HBM bytes
(each tensor argument read, each output written; views free; an ``out=`` buffer only written).
The GPU path's Triton kernels are replaced by recorders that count the bytes of their tensor
arguments (each read or written once: the tile, its 16-bit gradient, the per-row vectors). The
prediction is ``sum over ops of max(FLOPs / peak, bytes / bandwidth) + launch`` with spec-sheet
peaks (``kernels/_chunk_plan.py``: H100 SXM and H200 989 TFLOP/s dense bf16, 3.35 and 4.8 TB/s,
4 us a launch). The same walk gives the extra peak memory: the most bytes of tensors the call
allocated alive at once, less its outputs and the gradients it returns.

Rows: microrl's GPU path (``implementation="triton"``), its fused loss (``fused_linear_loss``
with the same objective: gradients formed in forward), its previous CUDA path (``"tiles"``, the
16-bit tile matmuls it takes on CUDA), Liger-Kernel's Triton fused linear cross-entropy with
``reduction="none"`` (log-probs only, bf16 logits) as an op list read from its code (it cannot
run here: its kernels are Triton), and the GEMM floors: 4 GEMMs (8 N H V FLOPs) for log-probs
and entropy with gradients, 3 for a loss fused into forward. Predictions, not measurements: the
spec peaks are not reached (the H200 check measured 787 TFLOP/s for one bf16 matmul), so the
ratios between rows are the figures to read (benchmarks/README.md, "Roofline").
"""

from __future__ import annotations

import argparse
import json
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from microrl.kernels import (
    _checks,
    _chunk_plan,
    _dispatch,
    fused_linear_logprob,
    fused_linear_loss,
    linear_logprob,
)

CASES = "8192x3584x152064,16384x2048x32768,4096x4096x128256"
MACHINES = (_chunk_plan.H100, _chunk_plan.H200)
_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}
_NO_TRAFFIC = {"empty", "empty_like", "new_empty", "empty_strided", "detach", "lift_fresh"}


def _bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches of ``t``: its elements, at most its storage (expanded views)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class Ops(TorchDispatchMode):
    """Counts ``(name, flops, bytes, dtype)`` per op and the peak bytes of live new storages."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, float, int, torch.dtype | None]] = []
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self._track(inputs, out)
        if func.is_view or name in _NO_TRAFFIC:
            return out
        written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        out_arg = kwargs.get("out")
        read = [t for t in inputs if t is not out_arg]
        flops, dtype = 0.0, None
        if name in _MATMULS:
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            flops = (
                2.0 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
            )
            dtype = a.dtype
        self.ops.append((name, flops, sum(map(_bytes, read + written)), dtype))
        return out

    def _track(self, inputs, out) -> None:
        """New storages among the outputs, counted until freed (``benchmarks/live_bytes.py``,
        keyed by storage identity: meta storages have no data pointer)."""
        seen = {t.untyped_storage()._cdata for t in inputs}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage._cdata in seen:
                continue
            seen.add(storage._cdata)
            self._add(storage.nbytes())
            weakref.finalize(storage, self._add, -storage.nbytes())

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def record(self, name: str, tensors) -> None:
        """A Triton launch: the bytes of its tensor arguments, no FLOPs on tensor cores."""
        self.ops.append((name, 0.0, sum(_bytes(t) for t in tensors if t is not None), None))


def seconds(ops, machine: _chunk_plan.Machine) -> float:
    total = 0.0
    for _, flops, nbytes, dtype in ops:
        peak = machine.flops32 if dtype in (torch.float32, torch.float64) else machine.flops16
        total += max(flops / peak, nbytes / machine.bandwidth) + machine.launch
    return total


class _Recorder:
    """Stands in for ``kernels/_triton_rows.py`` on meta tensors: records each launch."""

    TEMPS = 0

    def __init__(self, ops: Ops) -> None:
        self.ops = ops

    def stats(self, tile, col0, targets, inv_t, bias, scale, softcap, m, s, a, zt, first):
        per_row = inv_t if isinstance(inv_t, torch.Tensor) else None
        self.ops.record("triton_stats", (tile, targets, per_row, bias, m, s, a, zt))

    def grads(self, tile, out, col0, targets, inv_t, bias, scale, softcap, m, log_s, g_t, cc, bb):
        per_row = inv_t if isinstance(inv_t, torch.Tensor) else None
        self.ops.record("triton_grads", (tile, out, targets, per_row, bias, m, log_s, g_t, cc, bb))


def _validated(check):
    """``check_linear_logprob_inputs`` as with ``validate=True`` on targets none of which is
    ignored (its host read cannot run on meta tensors): every row counted."""

    def checked(hidden, weight, targets, temperature, bias, spec, **_):
        spec, per_token, _ = check(hidden, weight, targets, temperature, bias, spec, values=False)
        return spec, per_token, targets.numel()

    return checked


@contextmanager
def _patched(ops: Ops):
    """The Triton kernels recorded; the previous path's 16-bit tile matmuls (CUDA's) on meta;
    the validation's count of non-ignored rows (all of them) without a host read."""
    saved = (_dispatch.row_ops, linear_logprob._use_native16, _checks.check_linear_logprob_inputs)
    real = _dispatch.row_ops
    _dispatch.row_ops = lambda name: _Recorder(ops) if name == "triton" else real(name)
    linear_logprob._use_native16 = lambda hidden, weight: hidden.dtype == weight.dtype
    _checks.check_linear_logprob_inputs = _validated(saved[2])
    try:
        yield
    finally:
        _dispatch.row_ops, linear_logprob._use_native16, _checks.check_linear_logprob_inputs = saved


def count(impl: str, n: int, h: int, v: int, dtype=torch.bfloat16) -> tuple[list, int]:
    """``(ops, extra peak bytes)`` of one forward + backward of an implementation on meta."""
    hidden = torch.empty(n, h, device="meta", dtype=dtype, requires_grad=True)
    weight = torch.empty(v, h, device="meta", dtype=dtype, requires_grad=True)
    targets = torch.empty(n, device="meta", dtype=torch.long)
    g_lp, g_ent = (torch.empty(n, device="meta") for _ in range(2))
    ops = Ops()
    with _patched(ops), ops:
        if impl == "fused":

            def loss_fn(start, end, lp, ent):
                return (lp * g_lp[start:end]).sum() + (ent * g_ent[start:end]).sum(), None

            out = fused_linear_loss(hidden, weight, targets, loss_fn, with_entropy=True,
                                    implementation="triton")  # fmt: skip
            out.loss.backward()
            outputs = (out.logprobs, out.entropy)
        else:
            lp, ent = fused_linear_logprob(hidden, weight, targets, implementation=impl)
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            outputs = (lp, ent)
    returned = sum(_bytes(t) for t in (*outputs, hidden.grad, weight.grad))
    return ops.ops, ops.peak - returned


def liger_ops(n: int, h: int, v: int) -> tuple[list, int]:
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` with ``reduction="none"`` and bf16
    inputs, from its code (``ops/fused_linear_cross_entropy.py``): forward runs the chunk loop
    without gradients; backward runs it again with the per-token upstream gradient. Per chunk of
    ``next_pow2(ceil(n / ceil(v / h)))`` rows: the logits GEMM (bf16 out), its cross-entropy
    kernel (one pass over the chunk for the row statistics; in backward a second pass that
    writes the gradient over it), the multiply by the upstream gradient (a new chunk),
    ``grad_input = dZ @ W`` and ``grad_weight += dZ^T @ X`` (bf16, read and written). Extra
    memory: two bf16 chunks."""
    chunk = min(n, 1 << (-(-n // -(-v // h)) - 1).bit_length())
    ops = [("zeros", 0.0, n * h * 2 + v * h * 2, None)]  # grad_input, grad_weight
    for start in range(0, n, chunk):
        r = min(chunk, n - start)
        gemm = ("mm", 2.0 * r * h * v, (r * h + v * h + r * v) * 2, torch.bfloat16)
        ops += [gemm, ("liger_ce", 0.0, r * v * 2, None)]  # forward
        ops += [gemm, ("liger_ce", 0.0, 3 * r * v * 2, None), ("mul", 0.0, 2 * r * v * 2, None)]
        ops.append(("mm", 2.0 * r * h * v, (r * v + v * h + r * h) * 2, torch.bfloat16))
        ops.append(("addmm", 2.0 * r * h * v, (r * v + r * h + 2 * v * h) * 2, torch.bfloat16))
    return ops, 2 * chunk * v * 2


def floor_ops(n: int, h: int, v: int, gemms: int) -> list:
    return [("mm", 2.0 * n * h * v, 0, torch.bfloat16)] * gemms


def predict(n: int, h: int, v: int) -> dict:
    rows = {
        "microrl GPU path (triton)": count("triton", n, h, v),
        "microrl fused loss (triton)": count("fused", n, h, v),
        "microrl tiles (previous CUDA path)": count("tiles", n, h, v),
        "liger FLCE (op model)": liger_ops(n, h, v),
        "floor: 4 GEMMs": (floor_ops(n, h, v, 4), 0),
        "floor: 3 GEMMs (fused)": (floor_ops(n, h, v, 3), 0),
    }
    out = {}
    for name, (ops, extra) in rows.items():
        flops = sum(op[1] for op in ops)
        out[name] = {
            "ms": {m.name: 1e3 * seconds(ops, m) for m in MACHINES},
            "tflop": flops / 1e12,
            "gbytes": sum(op[2] for op in ops) / 1e9,
            "launches": len(ops),
            "extra_mib": extra / 2**20,
        }
    return out


def table(results: dict) -> str:
    names = [m.name for m in MACHINES]
    head = " | ".join(f"{m} ms | vs liger" for m in names)
    lines = [
        f"| N x H x V | path | {head} | TFLOP | GB moved | launches | extra MiB |",
        "|---|---|" + "---|---|" * len(names) + "---|---|---|---|",
    ]
    for case, rows in results.items():
        liger = rows["liger FLCE (op model)"]["ms"]
        for name, r in rows.items():
            cells = " | ".join(f"{r['ms'][m]:.1f} | {r['ms'][m] / liger[m]:.2f}x" for m in names)
            lines.append(
                f"| {case} | {name} | {cells} | {r['tflop']:.1f} | {r['gbytes']:.1f} | "
                f"{r['launches']} | {r['extra_mib']:.0f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=CASES, help=f"NxHxV,... (default {CASES})")
    parser.add_argument("--json", default=None, help="also write the predictions here")
    args = parser.parse_args(argv)
    results = {}
    for case in args.cases.split(","):
        n, h, v = (int(x) for x in case.split("x"))
        results[case] = predict(n, h, v)
    print("Predicted (roofline at spec peaks; bf16 inputs, forward + backward):\n")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
