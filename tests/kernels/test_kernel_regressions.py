"""Seed-bug regressions, gradcheck, the memory plan and input validation of the fused kernel.

The two seed bugs of the original kernel each get a check that runs on our kernel *and* on a
deliberately buggy tiny Function with that bug, to prove the check can fail:
(a) ``requires_grad`` lost by a flatten inside ``forward`` (the backbone got no gradient);
(b) ``set_materialize_grads(False)`` plus a ``None`` upstream gradient silently dropping a branch.
"""

from __future__ import annotations

import pytest
import torch
from kernel_utils import assert_close, run, shrink_tiles
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from microrl import kernels
from microrl.kernels import (
    WORKING_TILE_ELEMENTS,
    fused_linear_logprob,
    linear_logprob,
    reference_linear_logprob,
)
from microrl.kernels._checks import HeadSpec

H, V = 8, 30


def _logit_grad(logits, targets, g_lp, g_ent):
    """dL/dlogits for L = g_lp * log p(target) + g_ent * H(p), by the closed form."""
    log_p = torch.log_softmax(logits, -1)
    p = log_p.exp()
    entropy = -(p * log_p).sum(-1, keepdim=True)
    onehot = torch.nn.functional.one_hot(targets, logits.shape[-1]).to(logits.dtype)
    return onehot * g_lp[:, None] - p * (g_lp[:, None] + g_ent[:, None] * (log_p + entropy))


class _FlattenInsideForward(torch.autograd.Function):
    """Seed bug (a): flattens inside forward, where autograd is off, then gates on that copy."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        flat = hidden.reshape(-1, hidden.shape[-1])
        ctx.hidden_needs_grad = flat.requires_grad  # always False inside forward: the bug
        logits = flat @ weight.T
        ctx.save_for_backward(flat, weight, logits, targets.reshape(-1))
        log_p = torch.log_softmax(logits, -1)
        lp = log_p.gather(-1, targets.reshape(-1, 1)).squeeze(-1)
        return lp.view(targets.shape), (-(log_p.exp() * log_p).sum(-1)).view(targets.shape)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        flat, weight, logits, targets = ctx.saved_tensors
        grad = _logit_grad(logits, targets, g_lp.reshape(-1), g_ent.reshape(-1))
        grad_h = (grad @ weight).view(*g_lp.shape, -1) if ctx.hidden_needs_grad else None
        grad_w = grad.T @ flat if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None


class _DropsNoneBranch(torch.autograd.Function):
    """Seed bug (b): unmaterialised gradients, and only the 'both outputs used' case handled."""

    @staticmethod
    def forward(ctx, hidden, weight, targets):
        ctx.set_materialize_grads(False)
        logits = hidden @ weight.T
        ctx.save_for_backward(hidden, weight, logits, targets)
        log_p = torch.log_softmax(logits, -1)
        lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return lp, -(log_p.exp() * log_p).sum(-1)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, logits, targets = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        if g_lp is not None and g_ent is not None:  # a loss on one output silently gets nothing
            grad = _logit_grad(logits, targets, g_lp, g_ent)
        return grad @ weight, grad.T @ hidden, None


def _buggy(function):
    def call(hidden, weight, targets, **_):
        return function.apply(hidden, weight, targets)

    return call


def _assert_backbone_gets_reference_gradient(fn) -> None:
    """hidden comes out of a backbone layer as a [B, T, H] view: its parameters must get the reference
    gradient through the lm-head (frozen, as under LoRA, so hidden is the only path)."""
    grads = []
    for impl in (fn, reference_linear_logprob):
        torch.manual_seed(0)
        layer = torch.nn.Linear(H, H, dtype=torch.float64)
        x = torch.randn(5, 2, H, dtype=torch.float64)
        head = torch.randn(V, H, dtype=torch.float64)
        targets = torch.randint(0, V, (2, 5))
        # [T, B, H] -> [B, T, H]: a non-contiguous view, so a reshape inside forward must copy,
        # and a copy made there (autograd off) no longer requires grad.
        logprobs, entropy = impl(torch.tanh(layer(x)).transpose(0, 1), head, targets)
        (logprobs.sum() + 0.3 * entropy.sum()).backward()
        assert layer.weight.grad is not None, "backbone weight got no gradient"
        grads.append((layer.weight.grad, layer.bias.grad))
    assert grads[0][0].abs().sum() > 0
    assert_close(grads[0][0], grads[1][0], atol=1e-10, rtol=1e-9, name="backbone weight.grad")
    assert_close(grads[0][1], grads[1][1], atol=1e-10, rtol=1e-9, name="backbone bias.grad")


def _assert_single_output_losses_match_reference(fn) -> None:
    """A loss on the log-probs only, or on the entropy only: the unused output's upstream gradient
    arrives as None and must count as zero, not drop the other branch."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, V, (6,), generator=g)
    for grad_lp, grad_ent in ((1.0, None), (None, 1.0)):
        got = run(fn, hidden, weight, targets, grad_lp=grad_lp, grad_ent=grad_ent)
        want = run(
            reference_linear_logprob, hidden, weight, targets, grad_lp=grad_lp, grad_ent=grad_ent
        )
        for name, a, e in zip(("hidden.grad", "weight.grad"), got[2:], want[2:], strict=True):
            assert_close(a, e, atol=1e-10, rtol=1e-9, name=f"{grad_lp=} {grad_ent=} {name}")


def test_backbone_gradient_through_reshape():
    _assert_backbone_gets_reference_gradient(fused_linear_logprob)


def test_backbone_check_catches_flatten_inside_forward():
    with pytest.raises(AssertionError, match="no gradient"):
        _assert_backbone_gets_reference_gradient(_buggy(_FlattenInsideForward))


def test_single_output_losses_keep_their_branch():
    _assert_single_output_losses_match_reference(fused_linear_logprob)


def test_single_output_check_catches_unmaterialised_gradients():
    with pytest.raises(AssertionError, match="grad_lp="):
        _assert_single_output_losses_match_reference(_buggy(_DropsNoneBranch))


@pytest.mark.parametrize(
    "temperature, with_entropy, frozen_weight",
    [("per-token", True, False), (0.6, True, True), ("per-row", False, False)],
)
def test_gradcheck_float64(monkeypatch, temperature, with_entropy, frozen_weight):
    shrink_tiles(monkeypatch, 8)  # chunk_size=2 -> vocab tiles of 4, 4, 1 columns
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=not frozen_weight)
    targets = torch.randint(0, 9, (2, 3), generator=g)
    targets[1, 0] = -100
    temperature = {
        "per-token": torch.rand(2, 3, generator=g, dtype=torch.float64) + 0.5,
        "per-row": torch.rand(2, 1, generator=g, dtype=torch.float64) + 0.5,
    }.get(temperature, temperature)

    def fn(*inputs):
        h, w = inputs if len(inputs) == 2 else (inputs[0], weight)
        lp, ent = fused_linear_logprob(
            h, w, targets, temperature=temperature, chunk_size=2, with_entropy=with_entropy
        )
        return (lp, ent) if with_entropy else lp

    inputs = (hidden,) if frozen_weight else (hidden, weight)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 100, 256, 512, 2048, 4096, 10**6])
@pytest.mark.parametrize("vocab", [10, 8192, 32768, 151936])
@pytest.mark.parametrize("hidden_size", [256, 1024])
def test_default_plan_memory_budget(n, vocab, hidden_size):
    plan = linear_logprob._plan(n, vocab, HeadSpec(), (True, True), False, hidden_size)
    tile = plan.rows * plan.vocab_tile
    assert tile <= WORKING_TILE_ELEMENTS and plan.rows <= min(n, linear_logprob._DEFAULT_ROWS)
    # The vocabulary tile is a function of V (and chunk_size) only: 8192 columns by default.
    assert plan.vocab_tile == min(vocab, WORKING_TILE_ELEMENTS // linear_logprob._DEFAULT_ROWS)
    # All tile buffers (two working, the kept ones): at most four full tiles whatever N, and at
    # most a quarter of the materialised computation's extra memory (five [N, V] buffers less
    # the gradients, at least one), or the 1 MiB floor of tiny problems.
    buffers = (2 + plan.kept_tiles) * tile
    logits = n * vocab
    eager = max(5 * logits - (n + vocab) * hidden_size, logits)
    assert buffers <= 4 * WORKING_TILE_ELEMENTS
    assert buffers <= max(eager // 4, linear_logprob._MIN_BUFFER_ELEMENTS)
    # ... and the budget is used: a taller chunk or one more kept tile would not fit.
    chunks = -(-n // plan.rows)
    tiles = chunks * -(-vocab // plan.vocab_tile)
    budget = linear_logprob._buffer_budget(n, vocab, hidden_size, (True, True), 5)
    assert plan.kept_tiles == tiles or buffers + tile > budget
    # ... the working tiles within a quarter, with the kept ones within a fifth (or the floor)
    assert 2 * tile <= max(eager // 4, linear_logprob._MIN_BUFFER_ELEMENTS)
    assert plan.kept_tiles == 0 or buffers <= max(eager // 5, linear_logprob._MIN_BUFFER_ELEMENTS)
    if plan.rows < min(n, linear_logprob._DEFAULT_ROWS):  # budget-limited: even chunks
        working = linear_logprob._buffer_budget(n, vocab, hidden_size, (True, True), 4)
        assert 2 * (-(-n // (chunks - 1))) * plan.vocab_tile > working
        assert n - (chunks - 1) * plan.rows > plan.rows - chunks
    if n >= linear_logprob._DEFAULT_ROWS and eager // 5 >= 4 * WORKING_TILE_ELEMENTS:
        flat = linear_logprob._plan(8 * n, vocab, HeadSpec(), (True, True), False, hidden_size)
        assert plan == flat  # flat from here on


@pytest.mark.parametrize(
    "shape, rows, kept",
    [
        ((512, 256, 8192), 256, 0),  # two chunks at parity with eager instead of eight
        ((2048, 256, 8192), 1024, 0),
        ((2048, 1024, 32768), 1024, 2),  # large: four full tiles, two of them kept
        ((256, 896, 151936), 256, 3),  # the weight gradient dominates eager's peak
        ((1, 64, 1000), 1, 1),  # tiny: the floor; every tile kept, nothing recomputed
    ],
)
def test_plans_of_the_benchmark_grid(shape, rows, kept):
    n, hidden_size, vocab = shape
    plan = linear_logprob._plan(n, vocab, HeadSpec(), (True, True), False, hidden_size)
    assert (plan.rows, plan.vocab_tile, plan.kept_tiles) == (rows, min(vocab, 8192), kept)
    # The call's one tile block (test_tile_buffers_are_one_block_per_call) and the [N, H] hidden
    # gradient, both live at the kernel's peak, within the budget's share of eager's modelled
    # extra memory (five [N, V] buffers less the gradients): a fifth with kept tiles, a quarter
    # for the working tiles alone, or the floor. At 256 x 896 x 151936 (issue 23): 40 MiB of
    # tiles and 0.9 MiB against 222 MiB, measured 0.19x of eager (benchmarks/README.md).
    tiles = -(-n // plan.rows) * -(-vocab // plan.vocab_tile)
    working = linear_logprob._working_tiles(plan, tiles > plan.kept_tiles)
    block = (working + plan.kept_tiles) * plan.rows * plan.vocab_tile
    eager = max(5 * n * vocab - (n + vocab) * hidden_size, n * vocab)
    share = eager // (5 if plan.kept_tiles else 4)
    assert block + n * hidden_size <= max(share, linear_logprob._MIN_BUFFER_ELEMENTS)


class _FreshStorages(TorchDispatchMode):
    """Elements of every storage an op creates (an output on none of its inputs' storages)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_leaves((args, kwargs or {}))
        known = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                self.sizes.append(t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("kept", [None, 0, 1000], ids=["planned", "recompute-all", "keep-all"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_tile_buffers_are_one_block_per_call(monkeypatch, kept, softcap):
    """Issue 23: a call allocates its tile buffers once, one block (working tiles and kept ones)
    that forward fills and backward reuses; no other allocation is tile-sized. A tensor per tile,
    freed and allocated again between the phases, cost one or two tiles of peak RSS beyond the
    live buffers at 256 x 896 x 151936 (glibc serves such tiles from its heap once its mmap
    threshold has risen, and fragments it). Also with the .grad buffers existing (a second call)
    and when a retained graph runs backward twice."""
    import dataclasses

    shrink_tiles(monkeypatch, 60)  # chunk_size=6: 10-column tiles, 12 rows -> 2 chunks x 5 tiles
    n, hidden_size, vocab, tile = 12, 4, 50, 60
    if kept is not None:
        original = linear_logprob._plan
        monkeypatch.setattr(
            linear_logprob,
            "_plan",
            lambda *a: dataclasses.replace(original(*a), kept_tiles=min(kept, 10)),
        )
    plan = linear_logprob._plan(
        n, vocab, HeadSpec(chunk_size=6, softcap=softcap), (True, True), False, hidden_size
    )
    assert (plan.rows, plan.vocab_tile) == (6, 10) and n * hidden_size < tile
    working = 3 if softcap is not None and plan.kept_tiles < 10 else 2
    g = torch.Generator().manual_seed(23)
    hidden = torch.randn(n, hidden_size, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    grads = []
    for _ in range(2):  # the second call accumulates into the existing .grad buffers
        with _FreshStorages() as mode:
            lp, ent = fused_linear_logprob(hidden, weight, targets, chunk_size=6, softcap=softcap)
            (lp.sum() + ent.sum()).backward(retain_graph=True)
            (lp.sum() + ent.sum()).backward()  # the saved tiles are intact for a second backward
        large = [size for size in mode.sizes if size >= tile and size != vocab * hidden_size]
        assert large == [(working + plan.kept_tiles) * tile], (plan, mode.sizes)
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    # Four identical backwards in all: the reused block never leaked one call into the next.
    for got, first in zip(grads[1], grads[0], strict=True):
        assert_close(got, 2 * first, atol=1e-5, rtol=1e-5, name="accumulated")


def test_plan_without_gradients_keeps_nothing_and_models_a_forward():
    """No backward: nothing kept, and the budget models eager's forward (three [N, V] buffers)."""
    plan = linear_logprob._plan(512, 8192, HeadSpec(), (False, False), False, 256)
    assert plan.kept_tiles == 0
    assert 2 * plan.rows * plan.vocab_tile <= 3 * 512 * 8192 // 4


def test_no_grad_mode_returns_plain_tensors():
    hidden = torch.randn(3, 4, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    with torch.no_grad():
        logprobs, entropy = fused_linear_logprob(hidden, weight, torch.randint(0, V, (3, 4)))
    assert logprobs.grad_fn is None and entropy.grad_fn is None and (logprobs <= 0).all()


def _bad_inputs():
    h, w, t = torch.randn(2, 3, H), torch.randn(V, H), torch.randint(0, V, (2, 3))
    return [
        ("hidden", dict(hidden=torch.randn(H)), "rank >= 2"),
        (
            "hidden-int",
            dict(hidden=torch.ones(2, 3, H, dtype=torch.long)),
            "hidden must be a float",
        ),
        ("weight-1d", dict(weight=torch.randn(V)), "weight must be 2-D"),
        ("weight-3d", dict(weight=torch.randn(1, V, H)), "weight must be 2-D"),
        ("weight-H", dict(weight=torch.randn(V, H + 1)), "weight must be"),
        ("weight-int", dict(weight=torch.ones(V, H, dtype=torch.int32)), "weight must be a float"),
        ("targets-float", dict(targets=t.float()), "targets must be an integer"),
        ("targets-shape", dict(targets=t[:, :2]), "targets shape"),
        ("targets-high", dict(targets=torch.full((2, 3), V)), "targets must lie"),
        ("targets-negative", dict(targets=torch.full((2, 3), -1)), "targets must lie"),
        ("temperature-0", dict(temperature=0.0), "temperature"),
        ("temperature-negative", dict(temperature=-1.0), "temperature"),
        ("temperature-nan", dict(temperature=float("nan")), "temperature"),
        ("temperature-inf", dict(temperature=float("inf")), "temperature"),
        ("temperature-bool", dict(temperature=True), "temperature"),
        ("temperature-tensor-0", dict(temperature=torch.tensor([[1.0], [0.0]])), "temperature"),
        (
            "temperature-tensor-nan",
            dict(temperature=torch.full((2, 3), float("nan"))),
            "temperature",
        ),
        ("temperature-0dim-0", dict(temperature=torch.tensor(0.0)), "temperature"),
        ("temperature-shape", dict(temperature=torch.ones(3, 2)), "temperature shape"),
        ("temperature-grad", dict(temperature=torch.ones(2, 3, requires_grad=True)), "temperature"),
        ("chunk-0", dict(chunk_size=0), "chunk_size"),
        ("chunk-negative", dict(chunk_size=-4), "chunk_size"),
        ("chunk-float", dict(chunk_size=2.0), "chunk_size"),
        ("with-entropy", dict(with_entropy="yes"), "with_entropy"),
        ("ignore-index", dict(ignore_index=None), "ignore_index"),
    ], (h, w, t)


_CASES, _GOOD = _bad_inputs()


@pytest.mark.parametrize(
    "fn", [fused_linear_logprob, reference_linear_logprob], ids=["fused", "eager"]
)
@pytest.mark.parametrize("override, message", [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_bad_input_raises_value_error(fn, override, message):
    args = dict(zip(("hidden", "weight", "targets"), _GOOD, strict=True))
    args.update(override)
    with pytest.raises(ValueError, match=message):
        fn(**args)


def test_non_tensor_raises_type_error():
    with pytest.raises(TypeError, match="hidden"):
        fused_linear_logprob([[0.0] * H], torch.randn(V, H), torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize(
    "name",
    [
        "fused_linear_logprob",
        "reference_linear_logprob",
        "fused_linear_loss",
        "vocab_parallel_linear_logprob",
        "vocab_parallel_linear_loss",
    ],
)
def test_unknown_keyword_raises_type_error_naming_it(name):
    """The shared keywords are typed once (``**head: Unpack[HeadOptions]``): a misspelt one is
    still the TypeError Python raises for an unknown keyword."""
    fn = getattr(kernels, name)
    loss_fn = (lambda start, end, lp, ent: (lp.sum(), None),) if name.endswith("loss") else ()
    with pytest.raises(TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'tempe'"):
        fn(*_GOOD, *loss_fn, tempe=2.0)
