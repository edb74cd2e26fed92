"""The fp32 lm head and batch independence of fused_linear_logprob (and its eager reference).

Contract (docs/kernels.md): the result is ``log_softmax((hidden.float() @ weight.float().T) / T)``
(float64 when an input is float64) whatever the input dtypes, mixed ones included, and under
autocast: the logits are never rounded to 16 bits. Gradients come back in each input's dtype,
rounded once. The vocabulary tiling, and so the merge order of a row's statistics, does not depend
on how many rows a call has: a row's result depends on its batch only through BLAS rounding.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import assert_close, assert_outputs_close, run, shrink_tiles
from torch.utils._python_dispatch import TorchDispatchMode

from microrl.kernels import (
    _tiles,
    fused_linear_logprob,
    linear_logprob,
    reference_linear_logprob,
)
from microrl.kernels._checks import HeadSpec

H, V, N = 256, 500, 48
FNS = [fused_linear_logprob, reference_linear_logprob]
FN_IDS = ["fused", "eager"]


def make(dtype=torch.bfloat16, weight_dtype=None, seed=0, logit_std=7.0, n=N):
    """hidden [n, H], weight [V, H], targets [n] and random upstream gradients (float64). Logits
    have std ``logit_std``, so |logit| reaches ~25-30: where a bf16 logit's ulp is 0.125."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * logit_std * H**-0.5
    weight = weight.to(weight_dtype or dtype)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[3] = -100
    grads = torch.randn(2, n, generator=g, dtype=torch.float64)
    return hidden.requires_grad_(), weight.requires_grad_(), targets, grads


def truth(hidden, weight, targets, grads, **kwargs):
    """float64 reference on the very same (16-bit) values, upcast exactly."""
    h = hidden.detach().double().requires_grad_(hidden.requires_grad)
    w = weight.detach().double().requires_grad_(weight.requires_grad)
    return run(
        reference_linear_logprob, h, w, targets, grad_lp=grads[0], grad_ent=grads[1], **kwargs
    )


@pytest.fixture
def tiles(monkeypatch):
    """chunk_size=16 -> 96-column vocabulary tiles: V=500 is 5 tiles of 96 and one of 20."""
    shrink_tiles(monkeypatch, 16 * 96)


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "per-token"])
@pytest.mark.parametrize("chunk_size", [16, 64], ids=["3-chunks", "1-chunk"])
def test_16_bit_inputs_give_the_float32_head(tiles, fn, dtype, temperature, chunk_size):
    """Against float64 truth on the same 16-bit values. Values: a float32 logit summed over
    H=256 products is within ~1e-5 of exact, so log-probs and entropy are within 1e-4 (a logit
    rounded to bf16 at |z| ~ 16-32 is off by up to 0.06). Gradients: one rounding to the input
    dtype (see assert_outputs_close), whether the weight gradient accumulates over row chunks
    (float32 accumulator) or comes from one chunk (rounded per tile)."""
    hidden, weight, targets, grads = make(dtype)
    if temperature == "per-token":
        temperature = torch.rand(N, generator=torch.Generator().manual_seed(1)) + 0.5
    assert (hidden.double() @ weight.double().T).abs().max() > 16  # the regime that matters
    want = truth(hidden, weight, targets, grads, temperature=temperature)
    got = run(
        fn, hidden, weight, targets, grad_lp=grads[0].float(), grad_ent=grads[1].float(),
        temperature=temperature, chunk_size=chunk_size,
    )  # fmt: skip
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[2].dtype == got[3].dtype == dtype
    assert_outputs_close(got, want, values=(1e-4, 0.0), name=f"{dtype}")


MIXES = [
    (torch.bfloat16, torch.float32),  # autocast activations, fp32 master weight
    (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.float64),  # upcast to float64 (exact), not refused
]


@pytest.mark.parametrize("fn", FNS, ids=FN_IDS)
@pytest.mark.parametrize("hidden_dtype, weight_dtype", MIXES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("needs", ["both", "hidden", "weight"])
def test_mixed_dtypes_equal_the_upcast_call(tiles, fn, hidden_dtype, weight_dtype, needs):
    """Mixed inputs compute exactly what the call on both inputs upcast to the compute dtype
    computes: values to that dtype's rounding, gradients in each input's own dtype (the upcast
    call's gradient rounded once), ``.grad`` None where requires_grad=False."""
    hidden, weight, targets, grads = make(hidden_dtype, weight_dtype)
    hidden.requires_grad_(needs != "weight")
    weight.requires_grad_(needs != "hidden")
    cdtype = torch.float64 if torch.float64 in (hidden_dtype, weight_dtype) else torch.float32
    kwargs = {"grad_lp": grads[0].to(cdtype), "grad_ent": grads[1].to(cdtype), "chunk_size": 16}
    got = run(fn, hidden, weight, targets, temperature=0.8, **kwargs)
    up_h = hidden.detach().to(cdtype).requires_grad_(hidden.requires_grad)
    up_w = weight.detach().to(cdtype).requires_grad_(weight.requires_grad)
    want = run(fn, up_h, up_w, targets, temperature=0.8, **kwargs)
    assert got[0].dtype == got[1].dtype == cdtype
    assert (got[2] is None) == (needs == "weight") and (got[3] is None) == (needs == "hidden")
    for grad, dtype in ((got[2], hidden_dtype), (got[3], weight_dtype)):
        assert grad is None or grad.dtype == dtype
    rounded = [None if w is None else w.to(g.dtype) for g, w in zip(got[2:], want[2:], strict=True)]
    want = (*want[:2], *rounded)
    values = (1e-10, 1e-10) if cdtype == torch.float64 else (2e-5, 2e-5)
    assert_outputs_close(got, want, values=values, name=f"{hidden_dtype}/{weight_dtype}")


@pytest.mark.parametrize(
    "fn, backward_inside",
    [
        (fused_linear_logprob, False),
        (fused_linear_logprob, True),
        (reference_linear_logprob, False),
    ],
    ids=["fused", "fused-backward-inside", "eager"],
)
def test_autocast_does_not_round_the_logits(tiles, fn, backward_inside):
    """Under ``torch.autocast`` (bf16), the usual mixed-precision setting, the head still computes
    in float32: same results as outside autocast, and float32-accurate. The fused kernel's
    backward also ignores autocast; the eager reference's backward is autograd's (autocast rounds
    its matmuls if backward runs inside the context, which torch advises against)."""
    hidden, weight, targets, grads = make(torch.bfloat16, torch.float32)
    kwargs = {"grad_lp": grads[0].float(), "grad_ent": grads[1].float(), "chunk_size": 16}
    plain = run(fn, hidden, weight, targets, **kwargs)
    if backward_inside:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = run(fn, hidden, weight, targets, **kwargs)
    else:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs, entropy = fn(h, w, targets, chunk_size=16)
        ((logprobs * kwargs["grad_lp"]).sum() + (entropy * kwargs["grad_ent"]).sum()).backward()
        got = (logprobs.detach(), entropy.detach(), h.grad, w.grad)
    assert_outputs_close(got, plain, values=(1e-6, 1e-6), name="autocast vs plain")
    assert_outputs_close(got, truth(hidden, weight, targets, grads), values=(1e-4, 0.0))


def test_native_16_bit_matmul_path(tiles, monkeypatch):
    """The CUDA path (``torch.mm(..., out_dtype=torch.float32)`` on the 16-bit inputs), emulated
    here: the logits are the same float32 head; backward feeds the tensor cores the logit
    gradient G rounded to bf16 (2**-9 relative per entry), hence a looser gradient bound: one bf16
    ulp of the gradient's largest entry on top of the one-rounding bound (the error is at most
    2**-9 * sum_j |G_j| |W_j|, dominated by the target's entry ~|g_lp| / T times a weight)."""

    def emulated(a, b, out):
        return torch.mm(a.float(), b.float(), out=out)

    monkeypatch.setattr(linear_logprob, "_mm_fp32", emulated)
    monkeypatch.setattr(_tiles, "_mm_fp32", emulated)  # the logits tile's matmul
    monkeypatch.setattr(linear_logprob, "_use_native16", lambda h, w: h.dtype == w.dtype)
    hidden, weight, targets, grads = make(torch.bfloat16)
    for temperature in (1.0, 0.6, torch.rand(N, generator=torch.Generator().manual_seed(2)) + 0.5):
        want = truth(hidden, weight, targets, grads, temperature=temperature)
        for chunk_size in (16, 64):  # weight gradient accumulated over 3 chunks, or one chunk
            got = run(
                fused_linear_logprob, hidden, weight, targets, grad_lp=grads[0].float(),
                grad_ent=grads[1].float(), temperature=temperature, chunk_size=chunk_size,
            )  # fmt: skip
            assert got[2].dtype == got[3].dtype == torch.bfloat16
            assert_outputs_close(got, want, values=(1e-4, 0.0), grad_atol=2**-7)


class _LargestFloat32Output(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_16_bit_weight_gradient_float32_accumulator_only_when_needed(tiles):
    """A bf16 weight's gradient needs a float32 [V, H] accumulator only when it sums several row
    chunks; with one chunk each tile is rounded straight into the bf16 gradient."""
    hidden, weight, targets, _ = make(torch.bfloat16)
    for chunk_size, accumulates in ((64, False), (16, True)):
        with _LargestFloat32Output() as mode:
            run(fused_linear_logprob, hidden, weight, targets, chunk_size=chunk_size)
        assert (mode.largest >= V * H) == accumulates, (chunk_size, mode.largest)


def test_native_16_bit_is_cuda_only():
    h, w = torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(3, 4, dtype=torch.bfloat16)
    assert not linear_logprob._use_native16(h, w)  # a CPU upcasts: fp32 GEMM beats bf16 there


@pytest.mark.parametrize("vocab", [10, 1000, 32768, 151936])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 512])
def test_vocab_tiles_do_not_depend_on_the_row_count(vocab, chunk_size):
    plans = [
        linear_logprob._plan(n, vocab, HeadSpec(chunk_size=chunk_size))
        for n in (1, 7, 8, 300, 10**6)
    ]
    assert len({p.vocab_tile for p in plans}) == 1, [p.vocab_tile for p in plans]
    assert all(p.rows <= (chunk_size or linear_logprob._DEFAULT_ROWS) for p in plans)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_does_not_depend_on_its_batch(threads, dtype):
    """Default tiling (three 8192-column tiles at V=20000): the rows of a 300-row call equal the
    same rows computed in calls of 1, 7 and 8 rows. Not bitwise: BLAS blocks a GEMM differently
    for different row counts (a 1-row product is a GEMV), ~1e-7 relative on a float32 logit, and
    the hidden gradient, a sum over 8192-column tiles that cancels, carries ~1e-6 of its scale;
    the tile boundaries and the per-row merge order are the same."""
    g = torch.Generator().manual_seed(5)
    vocab, h = 20000, 32
    hidden = torch.randn(300, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, h, generator=g) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (300,), generator=g)
    full = run(fused_linear_logprob, hidden, weight, targets)
    for rows in (slice(0, 1), slice(150, 157), slice(292, 300)):
        part = run(fused_linear_logprob, hidden[rows], weight, targets[rows])
        for name, a, e in zip(("logprobs", "entropy", "hidden.grad"), part, full, strict=False):
            e = e[rows]
            if name == "hidden.grad":
                atol = 1e-5 * e.abs().max().item() + torch.finfo(dtype).eps * e.abs()
                assert ((a.double() - e.double()).abs() <= atol).all(), f"{rows} {name}"
            else:
                assert_close(a, e, atol=1e-5, rtol=1e-6, name=f"{rows} {name}")


# ----------------------------------------------------------------------------- large vocabularies
LARGE_V = 152064  # Qwen2.5's vocabulary


def test_a_peaked_row_at_a_152k_vocabulary_is_float64_accurate():
    """The eager float32 reference is not the ground truth at a large vocabulary: when one token
    holds nearly all the mass, the other 152k terms (each ~1e-8 of the sum, below float32's eps)
    are partly lost in its one long float32 sum, and its log-prob of the top token is ~6% low.
    The kernel sums each vocabulary tile on its own before merging, so it is compared with float64
    truth here, values and gradients, and is as close as float32 allows."""
    g = torch.Generator().manual_seed(0)
    # Logit of token 0 is 0, the others in [-18, -17.5): log p(0) ~ -V * e**-17.75 ~ -3e-3.
    weight = torch.zeros(LARGE_V, 2, dtype=torch.float64)
    weight[1:, 0] = -18.0 + 0.5 * torch.rand(LARGE_V - 1, generator=g, dtype=torch.float64)
    weight[:, 1] = 0.01 * torch.randn(LARGE_V, generator=g, dtype=torch.float64)
    hidden = torch.tensor([[1.0, 1.0], [1.0, -2.0]], dtype=torch.float64)
    targets = torch.tensor([0, 5])
    exact = run(reference_linear_logprob, hidden.requires_grad_(), weight.requires_grad_(), targets)
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    fused = run(fused_linear_logprob, h32, w32, targets)
    eager = run(reference_linear_logprob, h32, w32, targets)
    top = exact[0][0].item()
    assert -4e-3 < top < -2e-3
    # float32 holds log p(top) ~ -2.3e-3 to ~2e-10; a few ulps of 1 from the normaliser's sum.
    assert abs(fused[0][0].item() - top) <= 8 * torch.finfo(torch.float32).eps
    for name, got, want in zip(("logprobs", "entropy", "hidden.grad"), fused, exact, strict=False):
        scale = want.abs().max().item()
        assert_close(got, want, atol=1e-5 * scale + 1e-6, rtol=1e-5, name=name)
    # The weight gradient: p_j for the 152k small tokens, ~1e-8 each, to float32's resolution.
    assert_close(fused[3], exact[3], atol=1e-6, rtol=1e-4, name="weight.grad")
    # What the eager float32 reference gets (documented in docs/kernels.md): not a bound of the
    # kernel's, a reminder that it is no ground truth here.
    print(f"log p(top): float64 {top:.7f}, fused {fused[0][0]:.7f}, eager fp32 {eager[0][0]:.7f}")


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("validate", [False, True], ids=["validate=False", "validate=True"])
def test_the_kernel_under_torch_compile_equals_eager(validate):
    """docs/kernels.md: Dynamo traces the kernel's autograd.Function; with ``validate=False`` the
    call compiles as one graph (``fullgraph=True``), with ``validate=True`` the one host read of
    the target check is a graph break. Either way values and gradients equal the uncompiled call
    to float32 rounding (Inductor may fuse and reorder the elementwise math)."""
    import torch._dynamo

    hidden, weight, targets, _ = make(dtype=torch.float32, n=24)

    def call(h, w, t):
        logprobs, entropy = fused_linear_logprob(h, w, t, validate=validate)
        return logprobs, entropy

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=not validate)
    got = run(compiled, hidden, weight, targets, grad_lp=0.7, grad_ent=-0.3)
    want = run(call, hidden, weight, targets, grad_lp=0.7, grad_ent=-0.3)
    assert_outputs_close(got, want, values=(1e-5, 1e-5), name="compiled")
