"""The GPU check's kernel step: the fused lm head on CUDA tensors against float64 truth, and that
the GPU path is the one that ran.

    python benchmarks/kernel_cuda_check.py                     # on a GPU (gpu_check.sh runs it)
    python benchmarks/kernel_cuda_check.py --device cpu --implementation chunks --quick
                                                               # the same checks, tiny, on a CPU

Checks, each against the eager reference in float64 on the same (16-bit) values, with the
tolerances of tests/kernels/ (log-probs and entropy within 1e-4; gradients within 2**-7 of their
largest entry, the GPU path's 16-bit GEMMs taking the logit gradient rounded to 16 bits):

1. the precision test's case (logits up to ~30) in bf16 and fp16, scalar and per-token
   temperatures, one and several row blocks;
2. bf16 activations with a float32 weight under bf16 autocast (float32 GEMMs);
3. bias, logit scale and soft-capping with per-token temperatures, ignored rows;
4. the previous path forced (``implementation="tiles"``: its 16-bit tile matmuls on CUDA); the
   fused loss (``fused_linear_loss``) against the kernel + the loss + backward, and the
   vocab-parallel kernel on one rank (``group=None``);
5. (not with ``--quick``) a real head, 4096 x 2048 x 32768 with the default plan, and one with
   N * V > 2**31 (16384 x 256 x 152064) run once with the default plan and once in a single
   tile of 2.5e9 float32 logits, so the row kernels' int64 offsets are exercised; its float64
   truth is computed 1024 rows at a time.

Every call must run ``--implementation`` (default ``"triton"``: what ``"auto"`` takes for CUDA
tensors): the check fails when ``microrl.kernels.last_implementation()`` says otherwise, so a
fast path silently not taken fails the GPU check. Ends with a line ``KEY: ...``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from kernel_utils import GRAD_ATOL_16, assert_close, assert_outputs_close, run
from test_kernel_precision import make, truth

from microrl.kernels import (
    _chunk_plan,
    fused_linear_logprob,
    fused_linear_loss,
    last_implementation,
    reference_linear_logprob,
    vocab_parallel_linear_logprob,
)

VALUES = (1e-4, 0.0)


class Check:
    def __init__(self, device: str, implementation: str) -> None:
        self.device, self.expected = device, implementation
        # "auto" where the expected path is what auto takes on this device (CUDA: triton).
        self.impl = "auto" if device.startswith("cuda") and implementation == "triton" else None
        self.worst = 0.0

    def kwargs(self) -> dict:
        return {"implementation": self.impl or self.expected}

    def ran(self, name: str) -> None:
        got = last_implementation()
        if got != self.expected:
            raise SystemExit(f"{name}: ran the {got!r} implementation, not {self.expected!r}")

    def to(self, hidden, weight, targets, grads):
        hidden, weight = (t.detach().to(self.device).requires_grad_() for t in (hidden, weight))
        return hidden, weight, targets.to(self.device), grads.to(self.device)

    def compare(self, name, hidden, weight, targets, grads, autocast=False, **kwargs) -> None:
        want = truth(hidden, weight, targets, grads, **kwargs)
        up = {"grad_lp": grads[0].float(), "grad_ent": grads[1].float()}
        with torch.autocast(self.device.split(":")[0], torch.bfloat16, enabled=autocast):
            got = run(fused_linear_logprob, hidden, weight, targets, **up, **kwargs,
                      **self.kwargs())  # fmt: skip
        self.ran(name)
        assert_outputs_close(got, want, values=VALUES, grad_atol=GRAD_ATOL_16, name=name)
        self.worst = max(self.worst, (got[0].double() - want[0]).abs().max().item())
        print(f"ok {name}", flush=True)


def precision_cases(c: Check) -> None:
    """1-3: the precision test's inputs (tests/kernels/test_kernel_precision.py) on the device."""
    per_token = torch.rand(48, generator=torch.Generator().manual_seed(2)) + 0.5
    for dtype in (torch.bfloat16, torch.float16):
        inputs = c.to(*make(dtype))
        for temperature in (1.0, 0.6, per_token.to(c.device)):
            for chunk_size in (16, None):  # 3 row blocks, or the default plan
                label = "per-token" if torch.is_tensor(temperature) else temperature
                c.compare(f"{dtype} T={label} chunk={chunk_size}", *inputs,
                          temperature=temperature, chunk_size=chunk_size)  # fmt: skip
    c.compare("autocast bf16/fp32", *c.to(*make(torch.bfloat16, torch.float32)), autocast=True)
    hidden, weight, targets, grads = c.to(*make(torch.bfloat16))
    bias = torch.randn(weight.shape[0], device=c.device).bfloat16()
    c.compare("bias+scale+softcap", hidden, weight, targets, grads, bias=bias, logit_scale=0.7,
              softcap=20.0, temperature=per_token.to(c.device))  # fmt: skip


def tiles_case(c: Check) -> None:
    """The previous path, forced (``implementation="tiles"``): on CUDA its 16-bit tile matmuls
    with float32 output, over 3 row chunks; still within the same tolerances."""
    hidden, weight, targets, grads = c.to(*make(torch.bfloat16))
    want = truth(hidden, weight, targets, grads)
    got = run(fused_linear_logprob, hidden, weight, targets, grad_lp=grads[0].float(),
              grad_ent=grads[1].float(), implementation="tiles", chunk_size=16)  # fmt: skip
    if last_implementation() != "tiles":
        raise SystemExit(f"implementation='tiles' ran {last_implementation()!r}")
    assert_outputs_close(got, want, values=VALUES, grad_atol=GRAD_ATOL_16, name="tiles")
    print("ok tiles (the previous path, forced)", flush=True)


def fused_cases(c: Check) -> None:
    """4: the fused loss and the vocab-parallel kernel of one rank, on the device."""
    hidden, weight, targets, grads = c.to(*make(torch.bfloat16))
    adv = grads[0].float()

    def loss_fn(start, end, lp, ent):
        return (adv[start:end] * lp).sum() + 0.1 * (ent**2).sum(), None

    h, w = (t.detach().requires_grad_() for t in (hidden, weight))
    lp, ent = fused_linear_logprob(h, w, targets, **c.kwargs())
    ((adv * lp).sum() + 0.1 * (ent**2).sum()).backward()
    want = (lp.detach(), ent.detach(), h.grad, w.grad)
    h, w = (t.detach().requires_grad_() for t in (hidden, weight))
    out = fused_linear_loss(h, w, targets, loss_fn, with_entropy=True, segments=[0, 20, 48],
                            **c.kwargs())  # fmt: skip
    c.ran("fused_linear_loss")
    out.loss.backward()
    got = (out.logprobs, out.entropy, h.grad, w.grad)
    assert_outputs_close(got, want, values=(2e-5, 2e-5), grad_atol=GRAD_ATOL_16, name="fused")
    print("ok fused_linear_loss", flush=True)

    def vp(h, w, t, **kwargs):
        return vocab_parallel_linear_logprob(
            h, w, t, vocab_start=0, vocab_size=w.shape[0], **kwargs
        )

    want = truth(hidden, weight, targets, grads)
    got = run(vp, hidden, weight, targets, grad_lp=grads[0].float(), grad_ent=grads[1].float(),
              **c.kwargs())  # fmt: skip
    c.ran("vocab_parallel_linear_logprob")
    assert_outputs_close(got, want, values=VALUES, grad_atol=GRAD_ATOL_16, name="vocab-parallel")
    print("ok vocab_parallel_linear_logprob", flush=True)


def _random_head(n, h, v, device, logit_std=2.0, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, generator=g, device=device) * logit_std * h**-0.5).bfloat16()
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    grads = torch.randn(2, n, generator=g, device=device, dtype=torch.float64)
    return hidden, weight.requires_grad_(), targets, grads


def chunked_truth(hidden, weight, targets, grads, rows: int = 1024):
    """float64 truth of a head too large for one ``[N, V]`` float64 buffer: the eager
    reference on ``rows`` rows at a time, the weight gradient summed over them."""
    w = weight.detach().double().requires_grad_()
    lps, ents, ghs = [], [], []
    for start in range(0, hidden.shape[0], rows):
        part = slice(start, start + rows)
        h = hidden[part].detach().double().requires_grad_()
        lp, ent = reference_linear_logprob(h, w, targets[part])
        ((lp * grads[0][part]).sum() + (ent * grads[1][part]).sum()).backward()
        lps.append(lp.detach())
        ents.append(ent.detach())
        ghs.append(h.grad)
    return torch.cat(lps), torch.cat(ents), torch.cat(ghs), w.grad


def large_cases(c: Check) -> float:
    """5: a real head with the default plan (timed), and N * V > 2**31 in the default plan and in
    one tile of 2.5e9 logits. Returns the real head's milliseconds per forward + backward."""
    n, h, v = 4096, 2048, 32768
    hidden, weight, targets, grads = _random_head(n, h, v, c.device)
    c.compare(f"{n}x{h}x{v} bf16", hidden, weight, targets, grads)
    up = {"grad_lp": grads[0].float(), "grad_ent": grads[1].float()}
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        run(fused_linear_logprob, hidden, weight, targets, **up, **c.kwargs())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / 5 * 1e3
    del hidden, weight, targets, grads
    n, h, v = 16384, 256, 152064  # n * v = 2.49e9 > 2**31
    hidden, weight, targets, grads = _random_head(n, h, v, c.device, logit_std=6.0)
    want = chunked_truth(hidden, weight, targets, grads)
    up = {"grad_lp": grads[0].float(), "grad_ent": grads[1].float()}
    real_plan = _chunk_plan.plan_tiles
    for label, plan in (("default plan", None), ("one tile of 2.5e9 logits", (n, v))):
        if plan is not None:
            _chunk_plan.plan_tiles = lambda *a, temps=0, p=plan, **k: _chunk_plan.ChunkPlan(
                *p, temps
            )
        try:
            got = run(fused_linear_logprob, hidden, weight, targets, **up, **c.kwargs())
        finally:
            _chunk_plan.plan_tiles = real_plan
        c.ran(label)
        assert_outputs_close(got, want, values=VALUES, grad_atol=GRAD_ATOL_16, name=label)
        assert_close(got[0][-8:], want[0][-8:], atol=1e-4, rtol=0, name=f"{label} last rows")
        print(f"ok {n}x{h}x{v} (N*V = {n * v:.2e}), {label}", flush=True)
        del got
    return ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--implementation", default="triton", choices=("triton", "chunks"))
    parser.add_argument("--quick", action="store_true", help="no large heads (a CPU run)")
    args = parser.parse_args(argv)
    c = Check(args.device, args.implementation)
    precision_cases(c)
    tiles_case(c)
    fused_cases(c)
    timing = ""
    if not args.quick:
        timing = f"; 4096x2048x32768 {large_cases(c):.1f} ms/step, N*V > 2**31 ok"
    print(
        f"KEY: {c.expected} implementation ran; within tolerance of float64, max |dlogprob| "
        f"{c.worst:.1e}{timing}"
    )


if __name__ == "__main__":
    main()
