"""The Triton row kernels of the GPU path (``kernels/_triton_rows.py``) under Triton's interpreter
(``TRITON_INTERPRET=1``), on CPU tensors. Not collected by the suite: test_triton_rows.py runs
this file in a pytest process started with that variable (Triton reads it at import).

Each kernel against float64 truth on raw tiles (odd widths, a column offset, targets inside and
outside the tile, bias, scale, soft-cap, per-row and scalar temperatures, a first tile and a
merge; the gradient written as float32, or as bf16/fp16 over the tile's own bytes), then the
whole GPU path with them (``implementation="triton"``): the kernel, the fused loss and the
vocab-parallel kernel of one rank against float64 truth. The interpreter is serial: shapes are
tiny. Tolerances: float32 arithmetic on values of size ~10: 2e-5 relative; the 16-bit outputs:
one rounding (half an ulp; a whole one for bf16, which the interpreter truncates to).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_utils import (
    GRAD_ATOL_16,
    assert_close,
    assert_outputs_close,
    fixed_tiles,
    interpreted_triton,
    run,
)

from microrl.kernels import (
    _chunk_plan,
    fused_linear_logprob,
    fused_linear_loss,
    last_implementation,
    reference_linear_logprob,
    vocab_parallel_linear_logprob,
)

R, C, COL0 = 5, 37, 64  # a 5 x 37 tile of columns 64..100 of the vocabulary


@pytest.fixture
def kernels():
    return interpreted_triton()


def _tile_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    tile = torch.randn(R, C, generator=g) * 4
    targets = torch.tensor([COL0, COL0 + 36, COL0 - 1, COL0 + 37, COL0 + 10])  # in, in, out, out
    bias = torch.randn(C, generator=g)
    inv_t = torch.rand(R, generator=g) + 0.5
    return tile, targets, bias, inv_t


def _final64(tile, bias, inv_t, scale, cap):
    """The final logits in float64 and the soft-cap's tanh (u without a cap)."""
    u = (tile.double() + (0 if bias is None else bias.double())) * scale
    inv = inv_t.double().unsqueeze(1) if isinstance(inv_t, torch.Tensor) else inv_t
    if cap is None:
        return u * inv, u
    t = torch.tanh(u / cap)
    return t * cap * inv, t


HEADS = [
    dict(bias=False, scale=1.0, cap=None, per_row=False),
    dict(bias=True, scale=1.7, cap=None, per_row=True),
    dict(bias=True, scale=0.5, cap=2.5, per_row=True),
]


@pytest.mark.parametrize("head", HEADS, ids=["plain", "bias_scale_T", "all"])
@pytest.mark.parametrize("first", [True, False], ids=["first", "merge"])
def test_the_statistics_kernel(kernels, head, first):
    tile, targets, bias, inv_t = _tile_inputs()
    bias = bias if head["bias"] else None
    inv = inv_t if head["per_row"] else 0.8
    z, _ = _final64(tile, bias, inv, head["scale"], head["cap"])
    # Running statistics of an earlier tile (merge), its max above or below this tile's.
    m0 = torch.tensor([3.0, -2.0, 50.0, 0.0, 1.0])
    s0, a0 = torch.tensor([2.0, 1.5, 1.0, 3.0, 1.2]), torch.tensor([-0.5, -0.1, 0.0, -2.0, -0.3])
    m, s, a = m0.clone(), s0.clone(), a0.clone()
    zt = torch.full((R,), 7.0)
    kernels.stats(tile, COL0, targets, inv, bias, head["scale"], head["cap"], m, s, a, zt, first)
    want_m = z.amax(1)
    e = torch.exp(z - want_m.unsqueeze(1))
    want_s, want_a = e.sum(1), (e * (z - want_m.unsqueeze(1))).sum(1)
    if not first:  # the online merge, in float64
        mm = torch.maximum(m0.double(), want_m)
        w0, w1 = torch.exp(m0.double() - mm), torch.exp(want_m - mm)
        want_a = w0 * (a0.double() + (m0.double() - mm) * s0.double()) + w1 * (
            want_a + (want_m - mm) * want_s
        )
        want_s, want_m = w0 * s0.double() + w1 * want_s, mm
    want_zt = torch.tensor([z[0, 0], z[1, 36], 7.0, 7.0, z[4, 10]], dtype=torch.float64)
    for name, got, want in (
        ("m", m, want_m),
        ("s", s, want_s),
        ("a", a, want_a),
        ("zt", zt, want_zt),
    ):
        assert_close(got, want, atol=1e-5, rtol=2e-5, name=name)


@pytest.mark.parametrize("head", HEADS, ids=["plain", "bias_scale_T", "all"])
@pytest.mark.parametrize("out", ["float32", "bfloat16_in_place", "float16_in_place"])
def test_the_gradient_kernel(kernels, head, out):
    tile, targets, bias, inv_t = _tile_inputs(1)
    bias = bias if head["bias"] else None
    inv = inv_t if head["per_row"] else 0.8
    z, th = _final64(tile, bias, inv, head["scale"], head["cap"])
    g = torch.Generator().manual_seed(2)
    m = z.amax(1) + torch.rand(R, generator=g, dtype=torch.float64)  # a global max above it
    log_s = torch.rand(R, generator=g, dtype=torch.float64) + 1.0
    g_t, cc, bb = (torch.randn(R, generator=g, dtype=torch.float64) for _ in range(3))
    s = z - m.unsqueeze(1)
    want = -torch.exp(s - log_s.unsqueeze(1)) * (cc.unsqueeze(1) + bb.unsqueeze(1) * s)
    for row, col in ((0, 0), (1, 36), (4, 10)):  # the targets inside the tile
        want[row, col] += g_t[row]
    if head["cap"] is not None:
        want = want * (1 - th**2)
    if out == "float32":
        dst = torch.empty(R, C)
    else:  # over the tile's own bytes, row stride 2 * C, as the GPU path writes it
        dtype = getattr(torch, out.split("_")[0])
        dst = tile.view(dtype).view(R, 2 * C)[:, :C]
    args = [t.float() for t in (m, log_s, g_t, cc, bb)]
    kernels.grads(tile.clone() if out == "float32" else tile, dst, COL0, targets, inv, bias,
                  head["scale"], head["cap"], *args)  # fmt: skip
    # One rounding to 16 bits: half an ulp, but the interpreter truncates float32 -> bf16 (the GPU
    # rounds to nearest even), so up to one ulp for bf16.
    rtol = {"float32": 2e-5, "bfloat16_in_place": 2**-7, "float16_in_place": 2**-11}[out]
    assert_close(dst, want, atol=1e-5 * want.abs().max().item(), rtol=rtol, name=out)


def _make(dtype, n=11, h=16, v=45, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 2.5 / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[2] = -100
    grads = torch.randn(2, n, generator=g, dtype=torch.float64)
    return hidden, weight.requires_grad_(), targets, grads


def _truth(hidden, weight, targets, grads, **kwargs):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    if kwargs.get("bias") is not None:
        kwargs = {**kwargs, "bias": kwargs["bias"].double()}
    return run(reference_linear_logprob, h, w, targets, grad_lp=grads[0], grad_ent=grads[1],
               **kwargs)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_gpu_path_with_triton_equals_float64_truth(kernels, dtype, monkeypatch):
    """3 row blocks x 2 column slices, per-token temperature, bias, scale and soft-cap, random
    upstream gradients on both outputs; then plain, one tile, validate=False."""
    fixed_tiles(monkeypatch, 4, 32)
    hidden, weight, targets, grads = _make(dtype)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(3)).to(dtype)
    temperature = torch.rand(11, generator=torch.Generator().manual_seed(4)) + 0.5
    tol = dict(values=(2e-5, 2e-5), grad_atol=1e-5)
    if dtype == torch.bfloat16:
        tol = dict(values=(1e-4, 0.0), grad_atol=GRAD_ATOL_16)
    for kwargs in (
        dict(bias=bias, temperature=temperature, logit_scale=1.3, softcap=3.0),
        dict(validate=False),
    ):
        got = run(fused_linear_logprob, hidden, weight, targets, grad_lp=grads[0].float(),
                  grad_ent=grads[1].float(), implementation="triton", **kwargs)  # fmt: skip
        assert last_implementation() == "triton"
        assert_outputs_close(got, _truth(hidden, weight, targets, grads, **kwargs), **tol)


def test_the_fused_loss_with_triton_keeps_or_recomputes_its_tiles(kernels, monkeypatch):
    """``fused_linear_loss`` on the GPU path equals ``fused_linear_logprob`` + the loss +
    backward (float32), with groups kept in one tile (3 GEMMs) and with tiles recomputed."""
    hidden, weight, targets, grads = _make(torch.float32)
    segments = [0, 4, 7, 11]
    adv = grads[0].float()

    def loss_fn(start, end, lp, ent):
        return (adv[start:end] * lp).sum() + 0.1 * (ent**2).sum(), None

    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    lp, ent = fused_linear_logprob(h, w, targets)
    ((adv * lp).sum() + 0.1 * (ent**2).sum()).backward()
    want = (lp.detach(), ent.detach(), h.grad, w.grad)
    for budget in (2**30, 1):  # room for whole groups in a tile, or for no full row at all
        monkeypatch.setattr(_chunk_plan, "budget_bytes", lambda m, v, hh, b=budget: b)
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        out = fused_linear_loss(h, w, targets, loss_fn, segments=segments, with_entropy=True,
                                implementation="triton")  # fmt: skip
        out.loss.backward()
        got = (out.logprobs, out.entropy, h.grad, w.grad)
        assert_outputs_close(got, want, values=(2e-5, 2e-5), grad_atol=1e-5, name=str(budget))


def test_the_vocab_parallel_kernel_with_triton(kernels):
    """One rank holding the whole (padded) vocabulary: the shard's statistics, the exact
    combination and the gradient pass with global statistics (2 ranks: the vocab-parallel
    test files run the GPU path's torch twin)."""
    hidden, weight, targets, grads = _make(torch.float32)
    padded = torch.cat([weight.detach(), torch.full((3, 16), math.nan)]).requires_grad_()

    def fn(h, w, t, **kwargs):
        return vocab_parallel_linear_logprob(h, w, t, vocab_start=0, vocab_size=45, **kwargs)

    got = run(fn, hidden, padded, targets, grad_lp=grads[0].float(), grad_ent=grads[1].float(),
              implementation="triton", softcap=2.0)  # fmt: skip
    assert (got[3][45:] == 0).all()
    got = (*got[:3], got[3][:45])
    want = _truth(hidden, weight, targets, grads, softcap=2.0)
    assert_outputs_close(got, want, values=(2e-5, 2e-5), grad_atol=1e-5)
