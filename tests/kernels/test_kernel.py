"""fused_linear_logprob against its eager reference: values and gradients, every input shape.

Each case builds ``hidden``/``weight``/``targets`` once and runs both implementations on fresh
clones; :func:`kernel_utils.compare` checks log-probs, entropy and both gradients with per-dtype
tolerances and reports the worst element. Vocabulary tiling is forced at test sizes with
``shrink_tiles`` so the online (multi-tile) logsumexp/entropy merge is what gets tested.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import TOLERANCES, assert_close, assert_outputs_close, compare, run, shrink_tiles

from microrl.kernels import fused_linear_logprob, reference_linear_logprob

H, V = 16, 50  # V = 50 is not a multiple of the 7-column tiles forced below


def make(shape, *, dtype=torch.float32, seed=0, vocab=V, scale=1.0, ignore=()):
    """hidden [*shape, H] (requires grad), weight [V, H] (requires grad), targets [*shape]."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*shape, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, vocab, shape, generator=g)
    for index in ignore:
        targets[index] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def upstream(shape, seed, dtype):
    """Random upstream gradients (not 1, some negative) shaped like the outputs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


@pytest.fixture
def tiles(monkeypatch):
    """rows * 7 columns per tile: with chunk_size=3, V=50 splits into 7 tiles of 7 and one of 1."""
    shrink_tiles(monkeypatch, 21)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "shape, chunk_size",
    [((7,), 3), ((2, 5), 3), ((2, 2, 3), 3), ((1,), None), ((2, 5), None), ((2, 5), 1), ((0,), 3)],
    ids=["2d", "3d", "4d", "single-token", "one-chunk", "rows-of-one", "empty"],
)
def test_matches_reference(tiles, dtype, shape, chunk_size):
    hidden, weight, targets = make(shape, dtype=dtype)
    atol, rtol = TOLERANCES[dtype]
    odtype = torch.float64 if dtype == torch.float64 else torch.float32
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
        atol=atol, rtol=rtol, chunk_size=chunk_size,
        grad_lp=upstream(shape, 1, odtype), grad_ent=upstream(shape, 2, odtype),
    )  # fmt: skip


def test_output_dtypes_and_shapes():
    hidden, weight, targets = make((2, 3), dtype=torch.bfloat16)
    logprobs, entropy = fused_linear_logprob(hidden, weight, targets)
    assert logprobs.shape == entropy.shape == targets.shape
    assert logprobs.dtype == entropy.dtype == torch.float32
    hidden, weight, targets = make((2, 3), dtype=torch.float64)
    logprobs, entropy = fused_linear_logprob(hidden, weight, targets, with_entropy=False)
    assert logprobs.dtype == torch.float64 and entropy is None
    # Mixed dtypes compute in the wider one, at least float32: fp32 for 16/32-bit, fp64 with fp64.
    for h_dtype, w_dtype, out in [
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float16, torch.bfloat16, torch.float32),
        (torch.float32, torch.float64, torch.float64),
    ]:
        logprobs, entropy = fused_linear_logprob(hidden.to(h_dtype), weight.to(w_dtype), targets)
        assert logprobs.dtype == entropy.dtype == out


@pytest.mark.parametrize(
    "leaf_shape, prepare, target_shape",
    [
        ((5, 2), lambda h: h.transpose(0, 1), (2, 5)),  # [T, B, H] seen as [B, T, H]
        ((2, 5), lambda h: h[..., 3:], (2, 5)),  # last-dim slice: row stride != H
        ((4, 6), lambda h: h[::2, 1::2], (2, 3)),  # strided rows and columns
        (
            (3, 2),
            lambda h: h.transpose(0, 1).unsqueeze(0).expand(2, 2, 3, H + 3)[..., :H],
            (2, 2, 3),
        ),
    ],
    ids=["transpose", "slice-last-dim", "step-slices", "expanded"],
)
def test_non_contiguous_hidden(tiles, leaf_shape, prepare, target_shape):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(*leaf_shape, H + 3, generator=g, dtype=torch.float64).requires_grad_()
    _, weight, targets = make(target_shape, dtype=torch.float64)
    if prepare(hidden).shape[-1] != H:  # the transposes keep H + 3 columns: drop 3 at the end
        inner = prepare
        prepare = lambda h: inner(h)[..., :H]  # noqa: E731
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
        atol=1e-10, rtol=1e-9, prepare=prepare, chunk_size=3,
        grad_lp=upstream(target_shape, 4, torch.float64), grad_ent=upstream(target_shape, 5, torch.float64),
    )  # fmt: skip


@pytest.mark.parametrize("hidden_grad, weight_grad", [(True, False), (False, True), (True, True)])
def test_frozen_inputs_get_no_gradient(tiles, hidden_grad, weight_grad):
    """``.grad is None`` exactly when requires_grad=False; the others match the reference."""
    hidden, weight, targets = make((2, 5), dtype=torch.float64)
    hidden.requires_grad_(hidden_grad)
    weight.requires_grad_(weight_grad)
    got = run(fused_linear_logprob, hidden, weight, targets, chunk_size=3)
    want = run(reference_linear_logprob, hidden, weight, targets, chunk_size=3)
    assert (got[2] is None) == (not hidden_grad) and (got[3] is None) == (not weight_grad)
    for name, a, e in zip(
        ("logprobs", "entropy", "hidden.grad", "weight.grad"), got, want, strict=True
    ):
        assert_close(a, e, atol=1e-10, rtol=1e-9, name=name)


def test_frozen_weight_costs_no_weight_matmul(tiles, monkeypatch):
    """Under LoRA the lm-head is frozen: backward must not accumulate anything [V, H]-shaped."""
    from microrl.kernels import linear_logprob

    accumulated = []
    original = linear_logprob._addmm

    def spy(acc, a, b, overwrite):
        accumulated.append(tuple(acc.shape))
        original(acc, a, b, overwrite)

    monkeypatch.setattr(linear_logprob, "_addmm", spy)
    hidden, weight, targets = make((2, 5), dtype=torch.float64)
    weight.requires_grad_(False)
    run(fused_linear_logprob, hidden, weight, targets, chunk_size=3)
    assert accumulated and all(shape[1] == H and shape[0] <= 3 for shape in accumulated)
    accumulated.clear()
    hidden.requires_grad_(False)
    weight.requires_grad_(True)
    run(fused_linear_logprob, hidden, weight, targets, chunk_size=3)
    assert accumulated and all(shape[0] <= 7 for shape in accumulated)  # weight tiles only


@pytest.mark.parametrize(
    "grad_lp, grad_ent",
    [(1.0, None), (None, 1.0), (-2.5, 0.3), (0.0, 0.0), (None, 0.0), ("random", "random")],
    ids=["logprob-only", "entropy-only", "mixed-scaled", "zeros", "entropy-zero-only", "random"],
)
def test_every_mix_of_upstream_gradients(tiles, grad_lp, grad_ent):
    hidden, weight, targets = make((2, 5), dtype=torch.float64, ignore=[(0, 2)])
    grad_lp = upstream((2, 5), 6, torch.float64) if grad_lp == "random" else grad_lp
    grad_ent = upstream((2, 5), 7, torch.float64) if grad_ent == "random" else grad_ent
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
        atol=1e-10, rtol=1e-9, chunk_size=3, grad_lp=grad_lp, grad_ent=grad_ent,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "temperature",
    [0.7, 1.6, "0-dim", "per-token", "per-row"],
)
def test_temperature(tiles, dtype, temperature):
    hidden, weight, targets = make((3, 4), dtype=dtype)
    g = torch.Generator().manual_seed(8)
    temperature = {
        "0-dim": torch.tensor(0.45),
        "per-token": torch.rand(3, 4, generator=g) + 0.3,
        "per-row": torch.rand(3, 1, generator=g) + 0.3,
    }.get(temperature, temperature)
    atol, rtol = TOLERANCES[dtype]
    odtype = torch.float64 if dtype == torch.float64 else torch.float32
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
        atol=atol, rtol=rtol, chunk_size=3, temperature=temperature,
        grad_lp=upstream((3, 4), 9, odtype), grad_ent=upstream((3, 4), 10, odtype),
    )  # fmt: skip


@pytest.mark.parametrize("with_entropy", [True, False])
def test_ignore_index(tiles, with_entropy):
    """Ignored positions: log-prob 0, entropy 0, zero gradient to their hidden rows."""
    hidden, weight, targets = make((2, 5), dtype=torch.float64, ignore=[(0, 0), (1, 3), (1, 4)])
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
        atol=1e-10, rtol=1e-9, chunk_size=3, with_entropy=with_entropy,
        grad_lp=upstream((2, 5), 11, torch.float64), grad_ent=upstream((2, 5), 12, torch.float64),
    )  # fmt: skip
    logprobs, entropy, grad_h, _ = run(fused_linear_logprob, hidden, weight, targets, chunk_size=3)
    ignored = targets == -100
    assert (logprobs[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert (grad_h[ignored] == 0).all() and (grad_h[~ignored] != 0).any()


def test_custom_ignore_index_and_all_ignored(tiles):
    hidden, weight, targets = make((2, 5), dtype=torch.float64)
    targets[0, :] = 7
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
        atol=1e-10, rtol=1e-9, chunk_size=3, ignore_index=7,
    )  # fmt: skip
    targets.fill_(-100)
    logprobs, entropy, grad_h, grad_w = run(fused_linear_logprob, hidden, weight, targets)
    assert not logprobs.any() and not entropy.any() and not grad_h.any() and not grad_w.any()


@pytest.mark.parametrize("validate", [True, False])
def test_ignored_rows_are_never_read(tiles, validate):
    """Garbage (NaN) hidden states at padding positions cannot leak into outputs or gradients
    (``validate=False`` computes those rows, masked: the garbage must not leak there either)."""
    hidden, weight, targets = make((2, 5), dtype=torch.float64, ignore=[(0, 1), (1, 4)])
    poisoned = hidden.detach().clone()
    poisoned[0, 1] = float("nan")
    poisoned[1, 4] = float("inf")
    clean = hidden.detach().clone()
    clean[0, 1] = 0.0
    clean[1, 4] = 0.0
    got = run(
        fused_linear_logprob, poisoned.requires_grad_(), weight, targets, chunk_size=3,
        validate=validate,
    )  # fmt: skip
    want = run(reference_linear_logprob, clean.requires_grad_(), weight, targets, chunk_size=3)
    for name, a, e in zip(
        ("logprobs", "entropy", "hidden.grad", "weight.grad"), got, want, strict=True
    ):
        assert_close(a, e, atol=1e-10, rtol=1e-9, name=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_low_precision_is_the_float32_head(tiles, dtype, temperature):
    """16-bit inputs compute ``log_softmax((hidden.float() @ weight.float().T) / T)``: the same as
    the float32 call on the upcast inputs, for any values (not only ones whose logits happen to
    be exact in 16 bits), in both implementations. Values to float32 rounding; gradients in the
    input dtype, one rounding of the float32 gradient (test_kernel_precision.py compares with
    float64 truth at realistic logit sizes)."""
    hidden, weight, targets = make((4, 6), dtype=dtype, scale=2.0, ignore=[(1, 1)])
    kwargs = {
        "grad_lp": upstream((4, 6), 13, torch.float32),
        "grad_ent": upstream((4, 6), 14, torch.float32),
        "temperature": temperature,
        "chunk_size": 3,
    }
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    upcast = run(reference_linear_logprob, h32, w32, targets, **kwargs)
    want = (*upcast[:2], upcast[2].to(dtype), upcast[3].to(dtype))
    for fn in (fused_linear_logprob, reference_linear_logprob):
        got = run(fn, hidden, weight, targets, **kwargs)
        assert got[0].dtype == torch.float32 and got[2].dtype == got[3].dtype == dtype
        assert_outputs_close(got, want, values=TOLERANCES[torch.float32], name=f"{fn.__name__}")


@pytest.mark.parametrize("offset", [3e4, -3e4, 0.0], ids=["huge", "very-negative", "spread"])
def test_extreme_logits_stay_finite(tiles, offset):
    """Logits of size ~1e4 (and rows that are all very negative): float32 outputs and gradients
    finite and as close to float64 truth as the eager float32 reference gets. A bias column added
    to hidden and weight shifts every logit of a row by ``offset``; 'spread' instead scales the
    logits to a range of +-1e4. float32 holds a logit near 3e4 only to 2e-3, so log p (and p) carry
    that absolute error in any implementation; the bias column's weight gradient multiplies it by
    3e4 again. Hence the bound: the eager float32 error on the same inputs, or what float32 allows
    at all, one ulp of the largest logit times the gradient's factor (``max|W|`` for
    ``hidden.grad``, ``max|h|`` for ``weight.grad``), whichever is larger: which of two correct
    float32 implementations lands nearer depends on the CPU's BLAS blocking (seen on AMD EPYC:
    eager 3x nearer than the bound, the kernel 3.7x).
    """
    hidden, weight, targets = make((2, 5), dtype=torch.float64, scale=1.0)
    ones = torch.ones(2, 5, 1, dtype=torch.float64)
    big_h = torch.cat([hidden.detach() * (1.0 if offset else 500.0), ones * offset], -1)
    big_w = torch.cat([weight.detach(), torch.ones(V, 1, dtype=torch.float64)], -1)
    logit_scale = (big_h @ big_w.T).abs().max().item()
    eps = torch.finfo(torch.float32).eps
    truth = run(reference_linear_logprob, big_h.requires_grad_(), big_w.requires_grad_(), targets)
    h32, w32 = big_h.detach().float().requires_grad_(), big_w.detach().float().requires_grad_()
    got = run(fused_linear_logprob, h32, w32, targets, chunk_size=3)
    eager = run(reference_linear_logprob, h32, w32, targets)
    ulp = eps * logit_scale  # float32's absolute resolution of the largest logit
    factors = (0.0, 0.0, big_w.abs().max().item(), big_h.abs().max().item())
    names = ("logprobs", "entropy", "hidden.grad", "weight.grad")
    for name, g, e, t, factor in zip(names, got, eager, truth, factors, strict=True):
        eager_error = (e.double() - t).abs().max().item()
        # Values: the target logit and the row max come from differently-blocked matmuls than the
        # eager ones, so they may round differently by one float32 ulp of the largest logit.
        # Gradients: within 1.5x the eager float32 error (plus 1e-6 of their scale), or within
        # one ulp of the largest logit carried through the gradient's factor.
        if "grad" in name:
            atol = max(1.5 * eager_error + 1e-6 * t.abs().max().item(), ulp * factor)
        else:
            atol = 1.5 * eager_error + ulp
        assert_close(g, t, atol=atol, rtol=0.0, name=f"{offset} {name}")


def test_extra_memory_is_bounded_by_the_tile_not_n(monkeypatch):
    """No op output during forward+backward is [N, V]-sized: the largest is a tile, [V, H] or [N, H]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel())
            return out

    shrink_tiles(monkeypatch, 4096)
    n, vocab = 512, 2048
    hidden, weight, targets = make((n,), vocab=vocab)
    with LargestOutput():
        run(fused_linear_logprob, hidden, weight, targets)
    assert LargestOutput.largest <= max(4096, vocab * H, n * H) < n * vocab // 16


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_target_dtypes(dtype):
    hidden, weight, targets = make((2, 5), dtype=torch.float64)
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets.to(dtype),
        atol=1e-10, rtol=1e-9,
    )  # fmt: skip


def _vocab_parallel_whole(hidden, weight, targets, **kwargs):
    from microrl.kernels import vocab_parallel_linear_logprob

    return vocab_parallel_linear_logprob(
        hidden, weight, targets, vocab_start=0, vocab_size=weight.shape[0], **kwargs
    )


@pytest.mark.parametrize(
    "fn", [fused_linear_logprob, reference_linear_logprob, _vocab_parallel_whole],
    ids=["fused", "eager", "vocab-parallel"],
)  # fmt: skip
@pytest.mark.parametrize("validate", [True, False])
def test_narrow_target_dtypes_are_compared_as_int64(fn, validate):
    """uint8 156 is token 156, not ignore_index -100 (equal in uint8), and int8/uint8 ids of a
    vocabulary wider than the dtype are in range (``>= 300`` wraps in uint8)."""
    hidden, weight, _ = make((4,), dtype=torch.float64, vocab=300)
    ids = {torch.uint8: [156, 255, 3, 0], torch.int8: [100, -100, 127, -100]}
    for dtype, values in ids.items():
        wide = torch.tensor(values)
        want, _ = fn(hidden, weight, wide, validate=validate)
        got, _ = fn(hidden, weight, wide.to(dtype), validate=validate)
        assert_close(got, want, atol=1e-12, rtol=1e-12, name=str(dtype))
        assert (want[wide != -100] < 0).all()  # every position that is a token is computed


@pytest.mark.parametrize("kept_tiles", [0, 1, 1000], ids=["recompute-all", "keep-one", "keep-all"])
def test_kept_and_recomputed_tiles_agree(tiles, monkeypatch, kept_tiles):
    """Backward uses forward's tiles for the first ``kept_tiles`` and recomputes the rest."""
    import dataclasses

    from microrl.kernels import linear_logprob

    original = linear_logprob._plan

    def forced(*args):
        return dataclasses.replace(original(*args), kept_tiles=kept_tiles)

    monkeypatch.setattr(linear_logprob, "_plan", forced)
    hidden, weight, targets = make((2, 5), dtype=torch.float64, ignore=[(1, 1)])
    for with_entropy in (True, False):
        compare(
            fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
            atol=1e-10, rtol=1e-9, chunk_size=3, temperature=0.8, with_entropy=with_entropy,
            grad_lp=upstream((2, 5), 15, torch.float64), grad_ent=upstream((2, 5), 16, torch.float64),
        )  # fmt: skip


def test_nothing_is_kept_without_gradients(monkeypatch):
    """Tiles are kept for backward only when one will run: grad mode on and an input needing it."""
    from microrl.kernels import linear_logprob

    seen = []
    original = linear_logprob._plan

    def spy(*args):
        plan = original(*args)
        seen.append(plan.kept_tiles)
        return plan

    monkeypatch.setattr(linear_logprob, "_plan", spy)
    hidden, weight, targets = make((4,))
    fused_linear_logprob(hidden, weight, targets)
    with torch.no_grad():
        fused_linear_logprob(hidden, weight, targets)
    fused_linear_logprob(hidden.detach(), weight.detach(), targets)
    assert seen[0] > 0 and seen[1:] == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n, vocab", [(300, 9000), (20, 40000)], ids=["even-chunks", "partly-kept"])
@pytest.mark.parametrize(
    "ignored, validate",
    [((), True), ((3, 17), True), ((3, 17), False)],
    ids=["all-rows", "compacted", "masked"],
)
def test_default_plan_matches_reference(dtype, n, vocab, ignored, validate):
    """The real plan, no shrunk tiles: 300 x 9000 runs two budget-limited chunks of 150 rows and
    recomputes every tile; 20 x 40000 runs one chunk and keeps two of its five 8192-column
    tiles (the last one 7232 wide). Every row (views, in-place hidden gradient), compacted rows
    (validate=True with ignored targets) and masked rows (validate=False)."""
    from microrl.kernels import linear_logprob
    from microrl.kernels._checks import HeadSpec

    plan = linear_logprob._plan(n, vocab, HeadSpec(), (True, True), False, H)
    assert (plan.rows, plan.kept_tiles) == ((150, 0) if n == 300 else (20, 2))
    hidden, weight, targets = make((n,), dtype=dtype, vocab=vocab, ignore=ignored)
    atol, rtol = TOLERANCES[dtype]
    odtype = torch.float64 if dtype == torch.float64 else torch.float32
    temperature = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=odtype) + 0.5
    compare(
        fused_linear_logprob, reference_linear_logprob, hidden, weight, targets,
        atol=atol, rtol=rtol, temperature=temperature, validate=validate,
        grad_lp=upstream((n,), 7, odtype), grad_ent=upstream((n,), 8, odtype),
    )  # fmt: skip
