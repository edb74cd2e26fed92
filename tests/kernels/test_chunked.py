"""The GPU path of the fused lm head (``kernels/chunked.py``) run on CPU tensors with its torch
row ops (``implementation="chunks"``) against float64 truth, and its plan and memory model.

The Triton row kernels are the same algorithm's other backend: test_triton_rows.py runs them
under Triton's interpreter against these. Truth is the eager reference in float64 on the very
same (possibly 16-bit) values. Tolerances per dtype: float64 values 1e-10 and gradients 1e-12 of
their largest entry (summation order only); float32 values 2e-5, gradients one ulp plus 1e-5 of
the largest entry (kernel_utils.assert_outputs_close); 16-bit inputs values 1e-4 (float32
logits: the fp32-head bound of test_kernel_precision.py) and gradients ``GRAD_ATOL_16`` (the
16-bit GEMMs take the logit gradient rounded to 16 bits, as on a GPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernel_utils import GRAD_ATOL_16, assert_close, assert_outputs_close, fixed_tiles, run

from microrl.kernels import (
    _chunk_plan,
    _row_ops,
    chunked,
    fused_linear_logprob,
    fused_linear_loss,
    last_implementation,
    reference_linear_logprob,
)

N, H, V = 13, 24, 70  # odd: 70 columns are 2 slices of 32 and one of 6 with fixed_tiles(.., 32)
DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def tolerances(dtype: torch.dtype) -> dict:
    if dtype == torch.float64:
        return dict(values=(1e-10, 1e-10), grad_atol=1e-12)
    if dtype == torch.float32:
        return dict(values=(2e-5, 2e-5), grad_atol=1e-5)
    return dict(values=(1e-4, 0.0), grad_atol=GRAD_ATOL_16)


def make(dtype=torch.float32, n=N, h=H, v=V, seed=0, ignore=(3,), weight_dtype=None):
    """hidden [n, h], weight [v, h] (logits of std ~2.5), targets [n] with ``ignore`` positions
    -100, and random upstream gradients ``[2, n]`` (float64)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 2.5 * h**-0.5
    targets = torch.randint(0, v, (n,), generator=g)
    targets[[i for i in ignore if i < n]] = -100
    grads = torch.randn(2, n, generator=g, dtype=torch.float64)
    return (
        hidden.requires_grad_(),
        weight.to(weight_dtype or dtype).requires_grad_(),
        targets,
        grads,
    )


def truth(hidden, weight, targets, grads, *, grad_lp=True, grad_ent=True, **kwargs):
    """The eager reference in float64 on the same values, upcast exactly."""
    h = hidden.detach().double().requires_grad_(hidden.requires_grad)
    w = weight.detach().double().requires_grad_(weight.requires_grad)
    bias = kwargs.pop("bias", None)
    if bias is not None:
        kwargs["bias"] = bias.detach().double()
    return run(
        reference_linear_logprob, h, w, targets, grad_lp=grads[0] if grad_lp else None,
        grad_ent=grads[1] if grad_ent else None, **kwargs,
    )  # fmt: skip


def chunks(hidden, weight, targets, grads, *, grad_lp=True, grad_ent=True, **kwargs):
    cdtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    up = grads.to(cdtype)
    out = run(
        fused_linear_logprob, hidden, weight, targets, grad_lp=up[0] if grad_lp else None,
        grad_ent=up[1] if grad_ent else None, implementation="chunks", **kwargs,
    )  # fmt: skip
    assert last_implementation() == "chunks"
    return out


@pytest.fixture(params=["one_tile", "tiles"])
def tiling(request, monkeypatch):
    """The whole problem in one tile (the default plan at test sizes), or 4-row blocks by
    32-column slices: 4 blocks (the last of one row) x 3 slices (the last of 6 columns)."""
    if request.param == "tiles":
        fixed_tiles(monkeypatch, 4, 32)
    return request.param


# Each dtype once, with a per-token or a scalar temperature.
CASES = [("fp64", "per_token"), ("fp32", "scalar"), ("bf16", "per_token"), ("fp16", "scalar")]


@pytest.mark.parametrize("dtype, temperature", CASES, ids=[c[0] for c in CASES])
def test_the_gpu_path_equals_float64_truth(tiling, dtype, temperature):
    """Log-probs, entropy and both gradients under random upstream gradients on both outputs,
    one ignored row, a scalar or per-token temperature, one tile or many."""
    dtype = DTYPES[dtype]
    hidden, weight, targets, grads = make(dtype)
    if temperature == "per_token":
        temperature = torch.rand(N, generator=torch.Generator().manual_seed(1)) + 0.5
    else:
        temperature = 0.7
    got = chunks(hidden, weight, targets, grads, temperature=temperature)
    want = truth(hidden, weight, targets, grads, temperature=temperature)
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert got[0].dtype == got[1].dtype == cdtype
    assert got[2].dtype == got[3].dtype == dtype
    assert_outputs_close(got, want, name=f"{dtype} {tiling}", **tolerances(dtype))
    assert got[0][3] == got[1][3] == 0 and (got[2][3] == 0).all()  # the ignored row


@pytest.mark.parametrize("mix", ["lp_only", "ent_only", "lp_zero", "both_zero"])
def test_every_upstream_gradient_mix(mix, monkeypatch):
    """A loss on one output only (autograd hands the other's gradient as None: zeros, never a
    dropped branch), explicit zeros, all zero; several tiles."""
    fixed_tiles(monkeypatch, 4, 32)
    hidden, weight, targets, grads = make(torch.float32)
    if mix == "lp_zero":
        grads[0] = 0
    if mix == "both_zero":
        grads.zero_()
    flags = dict(grad_lp=mix != "ent_only", grad_ent=mix != "lp_only")
    got = chunks(hidden, weight, targets, grads, **flags)
    want = truth(hidden, weight, targets, grads, **flags)
    assert_outputs_close(got, want, name=mix, **tolerances(torch.float32))
    if mix != "both_zero":
        assert got[2].abs().max() > 1e-3 and got[3].abs().max() > 1e-3


HEADS = {
    "bias": dict(bias=True),
    "scale": dict(logit_scale=0.6),
    "softcap": dict(softcap=3.0),
    "all": dict(bias=True, logit_scale=1.7, softcap=2.5),
}


@pytest.mark.parametrize("head", HEADS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_transforms_against_float64(head, dtype, monkeypatch):
    """Bias (with its gradient), logit scale and soft-capping against float64 truth, per-token
    temperature, several tiles; soft-capping also without entropy."""
    fixed_tiles(monkeypatch, 4, 32)
    for with_entropy in (True, False) if head == "softcap" else (True,):
        _check_head(HEADS[head], dtype, with_entropy)


def _check_head(head: dict, dtype, with_entropy: bool) -> None:
    hidden, weight, targets, grads = make(dtype)
    kwargs = dict(head, with_entropy=with_entropy)
    kwargs["temperature"] = torch.rand(N, generator=torch.Generator().manual_seed(2)) + 0.5
    bias = None
    if kwargs.pop("bias", False):
        bias = torch.randn(V, generator=torch.Generator().manual_seed(3)).to(dtype)
        bias.requires_grad_()
    got_b, want_b = _bias_grads(hidden, weight, targets, grads, bias, kwargs)
    plain = None if bias is None else bias.detach()
    got = chunks(hidden, weight, targets, grads, bias=plain, **kwargs)
    want = truth(hidden, weight, targets, grads, bias=plain, **kwargs)
    assert_outputs_close(got, want, name=f"{head}", **tolerances(dtype))
    if bias is not None:
        scale = want_b.abs().max().item()
        atol = tolerances(dtype)["grad_atol"] * scale
        assert_close(got_b, want_b, atol=atol, rtol=torch.finfo(dtype).eps, name="bias.grad")


def _bias_grads(hidden, weight, targets, grads, bias, kwargs):
    """The bias gradient of the GPU path and of float64 truth (None, None without a bias)."""
    if bias is None:
        return None, None
    out = []
    for fn, b, cast, impl in (
        (fused_linear_logprob, bias, torch.float32, {"implementation": "chunks"}),
        (reference_linear_logprob, bias.detach().double().requires_grad_(), torch.float64, {}),
    ):
        b.grad = None
        h, w = hidden.detach().to(cast), weight.detach().to(cast)
        if cast == torch.float32:
            h, w = hidden.detach(), weight.detach()
        lp, ent = fn(h, w, targets, bias=b, **kwargs, **impl)
        loss = (lp * grads[0].to(lp.dtype)).sum()
        if ent is not None:
            loss = loss + (ent * grads[1].to(ent.dtype)).sum()
        loss.backward()
        out.append(b.grad)
    return out


@pytest.mark.parametrize("frozen", ["hidden", "weight", "bias", "hidden+weight", "all"])
def test_grad_is_none_exactly_when_not_required(frozen, monkeypatch):
    fixed_tiles(monkeypatch, 4, 32)
    hidden, weight, targets, grads = make(torch.bfloat16)
    bias = torch.randn(V).bfloat16()
    h = hidden.detach().requires_grad_("hidden" not in frozen and frozen != "all")
    w = weight.detach().requires_grad_("weight" not in frozen and frozen != "all")
    b = bias.requires_grad_("bias" not in frozen and frozen != "all")
    lp, ent = fused_linear_logprob(h, w, targets, bias=b, implementation="chunks")
    if lp.requires_grad:
        (lp * grads[0].float()).sum().add((ent * grads[1].float()).sum()).backward()
    for t in (h, w, b):
        assert (t.grad is None) == (not t.requires_grad), frozen
        if t.grad is not None:
            assert t.grad.dtype == t.dtype and t.grad.abs().max() > 0


def test_no_grad_keeps_nothing_and_equals_grad_mode():
    hidden, weight, targets, _ = make(torch.float32)
    with torch.no_grad():
        lp, ent = fused_linear_logprob(hidden, weight, targets, implementation="chunks")
    assert lp.grad_fn is None
    lp2, ent2 = fused_linear_logprob(hidden, weight, targets, implementation="chunks")
    assert torch.equal(lp, lp2.detach()) and torch.equal(ent, ent2.detach())


@pytest.mark.parametrize("validate", [True, False])
def test_odd_shapes(validate, monkeypatch):
    """One row; every row ignored; 3-D non-contiguous hidden; a vocabulary narrower than a slice."""
    fixed_tiles(monkeypatch, 4, 32)
    hidden, weight, targets, grads = make(torch.float32, n=1, ignore=())
    _check(hidden, weight, targets, grads, validate=validate)
    hidden, weight, targets, grads = make(torch.float32, ignore=range(N))
    got = chunks(hidden, weight, targets, grads, validate=validate)
    for t in got:
        assert_close(t, torch.zeros_like(t), atol=0, rtol=0, name="all ignored")
    base = torch.randn(2, 24, 7, generator=torch.Generator().manual_seed(4))
    hidden = base.transpose(1, 2).requires_grad_()  # [2, 7, 24], strides of a transpose
    targets = torch.randint(0, 10, (2, 7))
    weight = torch.randn(10, 24).requires_grad_()  # 10 columns: one slice
    _check(hidden, weight, targets, torch.randn(2, 2, 7, dtype=torch.float64), validate=validate)


def _check(hidden, weight, targets, grads, **kwargs):
    got = chunks(hidden, weight, targets, grads, **kwargs)
    want = truth(hidden, weight, targets, grads, **kwargs)
    assert_outputs_close(got, want, **tolerances(hidden.dtype))


def test_ignored_rows_hold_garbage_without_validation(monkeypatch):
    """``validate=False``: ignored rows are masked, not compacted; NaN in their hidden rows,
    temperatures and upstream gradients reaches nothing."""
    fixed_tiles(monkeypatch, 4, 32)
    hidden, weight, targets, grads = make(torch.float32, ignore=(0, 5, 12))
    temperature = torch.rand(N) + 0.5
    want = chunks(hidden, weight, targets, grads, temperature=temperature)
    poisoned = hidden.detach().clone()
    poisoned[[0, 5, 12]] = float("nan")
    temperature[[0, 5, 12]] = float("nan")
    grads[:, [0, 5, 12]] = float("nan")
    got = chunks(
        poisoned.requires_grad_(), weight, targets, grads, temperature=temperature, validate=False
    )
    assert_outputs_close(got, want, values=(1e-6, 1e-6), grad_atol=1e-6)


def test_mixed_dtypes_multiply_in_float32(monkeypatch):
    """bf16 activations with a float32 weight (autocast's case): float32 GEMMs on the upcast rows."""
    fixed_tiles(monkeypatch, 4, 32)
    hidden, weight, targets, grads = make(torch.bfloat16, weight_dtype=torch.float32)
    got = chunks(hidden, weight, targets, grads)
    want = truth(hidden, weight, targets, grads)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.float32
    assert_outputs_close(got, want, values=(2e-5, 2e-5), grad_atol=1e-5)


def test_gradcheck_through_every_transform(monkeypatch):
    fixed_tiles(monkeypatch, 3, 4)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 8, -100, 4, 3])
    temperature = torch.rand(5, generator=g, dtype=torch.float64) + 0.5

    def fn(h, w, b):
        return fused_linear_logprob(
            h, w, targets, bias=b, temperature=temperature, logit_scale=1.3, softcap=2.0,
            implementation="chunks",
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_triton_with_float64_inputs_is_refused():
    hidden, weight, targets, _ = make(torch.float64)
    with pytest.raises(ValueError, match="implementation='triton' computes in float32"):
        fused_linear_logprob(hidden, weight, targets, implementation="triton")


# ---------------------------------------------------------------------------- plan and memory

ISSUE_SHAPES = [(8192, 3584, 152064), (16384, 2048, 32768), (4096, 4096, 128256)]
BF16 = _chunk_plan.Sizes(2, 2, 4, 2)
NEED = (True, True, False)


def liger_extra_bytes(n: int, h: int, v: int) -> int:
    """Liger-Kernel's fused linear cross-entropy at its backward's peak with a per-token upstream
    gradient: two bf16 ``[chunk, v]`` buffers (the logits chunk holding its gradient, and that
    times the upstream gradient), ``chunk = next_pow2(ceil(n / ceil(v / h)))``."""
    chunk = min(n, 1 << (-(-n // -(-v // h)) - 1).bit_length())
    return 2 * chunk * v * 2


@pytest.mark.parametrize("shape", ISSUE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_plan_fits_ligers_memory_and_is_compute_bound(shape):
    """At the issue's shapes: the budget is at most Liger's extra memory, the plan's modelled
    extra memory fits the budget, and its modelled time on an H200 is within 1.25x of the 4-GEMM
    floor: the GEMMs compute-bound, plus the row kernels' 10 bytes per logit (about 0.15x of
    the GEMMs' time where V / H is 16) and the launches."""
    n, h, v = shape
    budget = _chunk_plan.budget_bytes(n, v, h)
    assert budget <= liger_extra_bytes(n, h, v)
    problem = _chunk_plan.Problem(n, v, h, BF16, NEED)
    plan = _chunk_plan.plan_tiles(problem, budget=budget)
    assert _chunk_plan.extra_bytes(problem, plan) <= budget
    floor = 8 * n * h * v / _chunk_plan.H200.flops16
    seconds = _chunk_plan.plan_seconds(problem, plan, _chunk_plan.H200)
    assert seconds <= 1.25 * floor, (plan, seconds, floor)
    assert plan.rows >= 1024 and plan.cols >= 1024  # tall blocks: at most a few dW roundings


def test_the_plan_respects_chunk_size_and_tiny_budgets():
    problem = _chunk_plan.Problem(8192, 32768, 1024, BF16, NEED)
    plan = _chunk_plan.plan_tiles(problem, budget=2**30, chunk_size=100)
    assert plan.rows <= 100
    tiny = _chunk_plan.plan_tiles(problem, budget=1)
    assert tiny == _chunk_plan.ChunkPlan(_chunk_plan.MIN_ROWS, _chunk_plan.COL_ALIGN)


def _live_bytes():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from live_bytes import LiveBytes

    return LiveBytes


@pytest.mark.parametrize(
    "case",
    ["fp32_tiles", "fp32_one_slice", "bf16_tiles", "bias_ignored"],
)
def test_the_memory_model_bounds_the_allocations(case, monkeypatch):
    """Peak bytes of every tensor a forward + backward allocates (``benchmarks/live_bytes.py``),
    less the outputs and the gradients it returns, are within the memory model
    (``_chunk_plan.extra_bytes``) and at least 70% of it (a model that is far too loose would
    waste the budget). bf16 on a CPU: the model with emulated (upcast) 16-bit GEMMs."""
    n, h, v = 64, 48, 1000
    dtype = torch.bfloat16 if case.startswith("bf16") else torch.float32
    hidden, weight, targets, grads = make(dtype, n=n, h=h, v=v, ignore=())
    if case == "bias_ignored":
        targets[::5] = -100
    bias = torch.randn(v, requires_grad=True) if case == "bias_ignored" else None
    weight.requires_grad_(case != "frozen_weight")
    cols = v if case == "fp32_one_slice" else 256
    fixed_tiles(monkeypatch, 16, cols)
    live_bytes = _live_bytes()
    with live_bytes() as live:
        lp, ent = fused_linear_logprob(hidden, weight, targets, bias=bias, implementation="chunks")
        ((lp * grads[0].float()).sum() + (ent * grads[1].float()).sum()).backward()
    returned = sum(
        t.numel() * t.element_size()
        for t in (lp, ent, hidden.grad, weight.grad, None if bias is None else bias.grad)
        if t is not None
    )
    count = int((targets != -100).sum())
    sizes = _chunk_plan.Sizes(dtype.itemsize, dtype.itemsize, 4, dtype.itemsize)
    need = (True, weight.requires_grad, bias is not None)
    problem = _chunk_plan.Problem(
        count, v, h, sizes, need, bias=bias is not None, row_copies=case == "bias_ignored",
        native16=False,
    )  # fmt: skip
    model = _chunk_plan.extra_bytes(problem, _chunk_plan.ChunkPlan(16, cols, _row_ops.TEMPS))
    measured = live.peak - returned
    assert 0.7 * model <= measured <= model, (case, measured, model)


# ---------------------------------------------------------------------------- the fused loss


def _loss_fn(adv):
    """A per-group loss of log-probs and entropy (GRPO-like, plus an entropy term)."""

    def loss_fn(start, end, lp, ent):
        return -(adv[start:end].to(lp.dtype) * lp).sum() + 0.1 * (ent**2).sum(), (start, end)

    return loss_fn


@pytest.mark.parametrize("mode", ["kept", "recomputed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_the_fused_loss_equals_logprob_plus_loss(mode, dtype, monkeypatch):
    """``fused_linear_loss`` on the GPU path equals ``fused_linear_logprob`` (CPU tiles) + the
    loss + backward: groups kept in one tile each (3 GEMMs: the backward GEMM skipped), or
    recomputed in 4 x 32 tiles (a budget with no room for a whole row). Sequences of 4, 2, 5
    and 2 rows with a temperature, bias and soft-cap."""
    hidden, weight, targets, grads = make(dtype)
    bias = torch.randn(V, generator=torch.Generator().manual_seed(6)).to(dtype)
    kwargs = dict(temperature=0.8, bias=bias, softcap=4.0)
    adv = grads[0]
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    lp, ent = fused_linear_logprob(h, w, targets, **kwargs)
    loss = _loss_fn(adv)(0, N, lp, ent)[0]
    loss.backward()
    want = (loss.detach(), lp.detach(), ent.detach(), h.grad, w.grad)
    if mode == "recomputed":
        fixed_tiles(monkeypatch, 4, 32)
        monkeypatch.setattr(_chunk_plan, "budget_bytes", lambda m, v, hh: 1)
    gemms = []
    real = chunked._gemm
    monkeypatch.setattr(chunked, "_gemm", lambda *a, **k: gemms.append(1) or real(*a, **k))
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    out = fused_linear_loss(h, w, targets, _loss_fn(adv), segments=[0, 4, 6, 11, 13],
                            with_entropy=True, implementation="chunks", **kwargs)  # fmt: skip
    out.loss.backward()
    assert last_implementation() == "chunks"
    got = (out.loss.detach(), out.logprobs, out.entropy, h.grad, w.grad)
    tol = tolerances(dtype)
    assert_close(got[0], want[0], atol=tol["values"][0], rtol=1e-6, name="loss")
    assert_outputs_close(got[1:], want[1:], name=mode, **tol)
    groups = out.aux
    if mode == "kept":  # one tile per group: its logits, hidden- and weight-gradient GEMMs
        assert len(gemms) == 3 * len(groups), (gemms, groups)
    else:  # 4 per tile: the backward recomputes the logits
        tiles = sum(-(-(end - start) // 4) * 3 for start, end in groups)
        assert len(gemms) == 4 * tiles, (len(gemms), tiles)
