"""The lm-head transforms of ``fused_linear_logprob``: bias, logit scale, final-logit soft-capping.

``logits = cap((h @ W.T + b) * scale) / T`` with ``cap(x) = c * tanh(x / c)``. The ground truth is
written here, in float64 on the very same values (16-bit inputs upcast exactly), with autograd
through ``tanh`` for the soft-capping slope; the kernel's values and its gradients to ``hidden``,
``weight`` and ``bias`` must match it for every tile path (kept from forward, recomputed, native
16-bit matmuls), temperature form, ignore pattern and upstream-gradient mix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_utils import assert_close, shrink_tiles

from microrl.kernels import (
    _tiles,
    fused_linear_logprob,
    linear_logprob,
    reference_linear_logprob,
)

H, V = 24, 61  # V is not a multiple of the forced tile width
# Logits are ~N(0, 1.2**2) before the transform: a cap of 2 bends many of them (tanh slope down
# to ~0.1 on the largest), a scale of 0.5 or 1.5 changes every probability.
TRANSFORMS = {
    "bias": dict(bias=True),
    "scale": dict(logit_scale=1.5),
    "softcap": dict(softcap=2.0),
    "all": dict(bias=True, logit_scale=0.5, softcap=2.0),
}
# Values (atol, rtol) against float64 truth on the same inputs: float32 logits of size ~1-5 over
# H=24 products differ from exact by a few ulps; the transform adds a few more (tanh, scaling).
VALUE_TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-5, 2e-5),
}


def make(shape, *, dtype=torch.float32, seed=0, scale=1.0, ignore=((0,),)):
    """hidden [*shape, H], weight [V, H], bias [V] (all requiring grad), targets [*shape] with the
    ``ignore`` positions set to -100 (those that exist in ``shape``)."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*shape, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.25).to(dtype)
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    targets = torch.randint(0, V, shape, generator=g)
    for index in ignore:
        if len(index) == len(shape) and all(i < s for i, s in zip(index, shape, strict=True)):
            targets[index] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), targets


def upstream(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def truth(hidden, weight, bias, targets, *, temperature=1.0, with_entropy=True, grads=(1.0, 1.0),
          logit_scale=1.0, softcap=None):  # fmt: skip
    """float64 eager definition on the same values; returns outputs and the three gradients."""
    h, w, b = (
        None if x is None else x.detach().double().requires_grad_(x.requires_grad)
        for x in (hidden, weight, bias)
    )
    z = h @ w.T
    if b is not None:
        z = z + b
    z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    t = torch.as_tensor(temperature, dtype=torch.float64)
    z = z / (t.unsqueeze(-1) if t.dim() else t)
    logp = torch.log_softmax(z, dim=-1)
    valid = targets != -100
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(valid, picked, 0.0)
    entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0) if with_entropy else None
    return _backprop(logprobs, entropy, grads, (hidden, weight, bias), (h, w, b))


def kernel(fn, hidden, weight, bias, targets, *, grads=(1.0, 1.0), **kwargs):
    """``fn`` on fresh leaves cloned from the inputs (same requires_grad)."""
    leaves = [
        None if x is None else x.detach().clone().requires_grad_(x.requires_grad)
        for x in (hidden, weight, bias)
    ]
    h, w, b = leaves
    logprobs, entropy = fn(h, w, targets, bias=b, **kwargs)
    return _backprop(logprobs, entropy, grads, (hidden, weight, bias), leaves)


def _backprop(logprobs, entropy, grads, originals, leaves):
    terms = []
    if grads[0] is not None:
        terms.append((logprobs * grads[0]).sum())
    if grads[1] is not None and entropy is not None:
        terms.append((entropy * grads[1]).sum())
    if terms and any(x is not None and x.requires_grad for x in leaves):
        sum(terms).backward()
    out = [logprobs.detach(), None if entropy is None else entropy.detach()]
    return out + [None if x is None else x.grad for x in leaves]


def assert_matches(got, want, *, values, grad_atol=1e-5, name=""):
    """Values within ``values = (atol, rtol)``; each gradient within one ulp of its dtype relative
    (it is rounded once from the compute dtype) plus ``grad_atol`` times its largest entry (a sum
    over the vocabulary that cancels leaves an absolute float32 error of that scale)."""
    labels = ("logprobs", "entropy", "hidden.grad", "weight.grad", "bias.grad")
    for label, a, e in zip(labels, got, want, strict=True):
        full = f"{name} {label}".strip()
        if label.endswith("grad") and a is not None and e is not None:
            assert a.dtype != torch.float64 or e.dtype == torch.float64
            scale = e.abs().max().item() if e.numel() else 0.0
            rtol = torch.finfo(a.dtype).eps
            assert_close(a, e, atol=grad_atol * scale, rtol=rtol, name=full)
        else:
            assert_close(a, e, atol=values[0], rtol=values[1], name=full)


def transform_kwargs(name, bias):
    """``(bias or None, the kernel's other transform arguments)`` of one ``TRANSFORMS`` entry."""
    kwargs = dict(TRANSFORMS[name])
    return (bias if kwargs.pop("bias", False) else None), kwargs


@pytest.fixture
def tiles(monkeypatch):
    """rows * 7 columns per tile: with chunk_size=3, V=61 splits into 8 tiles of 7 and one of 5."""
    shrink_tiles(monkeypatch, 21)


def force_kept(monkeypatch, kept_tiles):
    original = linear_logprob._plan

    def forced(*args):
        return dataclasses.replace(original(*args), kept_tiles=kept_tiles)

    monkeypatch.setattr(linear_logprob, "_plan", forced)


@pytest.mark.parametrize("kept", [0, 1, 1000], ids=["recompute-all", "keep-one", "keep-all"])
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"]
)
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_matches_float64_truth(tiles, monkeypatch, transform, dtype, kept):
    """Per-token temperature, an ignored position, random upstream gradients, three row chunks of
    nine vocabulary tiles; backward from forward's kept tiles, recomputed ones, or a mix."""
    force_kept(monkeypatch, kept)
    hidden, weight, bias, targets = make((2, 4), dtype=dtype, ignore=[(0, 1)])
    bias, kwargs = transform_kwargs(transform, bias)
    temperature = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) + 0.5
    grads = upstream((2, 4), 2), upstream((2, 4), 3)
    want = truth(hidden, weight, bias, targets, temperature=temperature, grads=grads, **kwargs)
    got = kernel(
        fused_linear_logprob, hidden, weight, bias, targets, grads=grads,
        temperature=temperature, chunk_size=3, **kwargs,
    )  # fmt: skip
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert all(g is None or g.dtype == dtype for g in got[2:])
    assert (got[4] is None) == (bias is None)
    assert_matches(
        got, want, values=VALUE_TOL[dtype], grad_atol=1e-10 if dtype == torch.float64 else 1e-5
    )


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_reference_matches_float64_truth(transform):
    """The eager twin computes the same transform (its float32 values against float64 truth)."""
    hidden, weight, bias, targets = make((3, 5))
    bias, kwargs = transform_kwargs(transform, bias)
    grads = upstream((3, 5), 4), upstream((3, 5), 5)
    want = truth(hidden, weight, bias, targets, temperature=0.8, grads=grads, **kwargs)
    got = kernel(
        reference_linear_logprob, hidden, weight, bias, targets, grads=grads, temperature=0.8,
        **kwargs,
    )  # fmt: skip
    assert_matches(got, want, values=VALUE_TOL[torch.float32])


@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, "per-row"])
@pytest.mark.parametrize(
    "grads", [("random", "random"), ("random", None), (None, "random"), (0.0, 0.0)],
    ids=["both", "lp-only", "entropy-only", "zeros"],
)  # fmt: skip
def test_temperatures_entropy_and_upstream_mixes(tiles, with_entropy, temperature, grads):
    hidden, weight, bias, targets = make((3, 4), dtype=torch.float64, ignore=[(1, 2)])
    if temperature == "per-row":
        temperature = torch.tensor([[0.7], [1.3], [0.9]], dtype=torch.float64)
    grads = tuple(upstream((3, 4), 6 + i) if g == "random" else g for i, g in enumerate(grads))
    bias, kwargs = transform_kwargs("all", bias)
    want = truth(hidden, weight, bias, targets, temperature=temperature, grads=grads,
                 with_entropy=with_entropy, **kwargs)  # fmt: skip
    got = kernel(
        fused_linear_logprob, hidden, weight, bias, targets, grads=grads, chunk_size=3,
        temperature=temperature, with_entropy=with_entropy, **kwargs,
    )  # fmt: skip
    assert_matches(got, want, values=VALUE_TOL[torch.float64], grad_atol=1e-10)


@pytest.mark.parametrize(
    "shape, chunk_size",
    [((1,), None), ((0,), 3), ((2, 2, 3), 3), ((37,), None)],
    ids=["single-token", "empty", "3d", "one-chunk"],
)
def test_odd_shapes(tiles, shape, chunk_size):
    hidden, weight, bias, targets = make(shape, seed=7)
    kwargs = dict(logit_scale=0.5, softcap=2.0)
    grads = upstream(shape, 8, torch.float32), upstream(shape, 9, torch.float32)
    want = truth(hidden, weight, bias, targets, temperature=0.9, grads=grads, **kwargs)
    got = kernel(fused_linear_logprob, hidden, weight, bias, targets, grads=grads,
                 temperature=0.9, chunk_size=chunk_size, **kwargs)  # fmt: skip
    assert got[0].shape == shape
    assert_matches(got, want, values=VALUE_TOL[torch.float32])


@pytest.mark.parametrize(
    "needs", [(True, True, False), (False, False, True), (True, False, True)],
    ids=["frozen-bias", "bias-only", "frozen-weight"],
)  # fmt: skip
def test_grad_is_none_exactly_for_frozen_inputs(tiles, needs):
    hidden, weight, bias, targets = make((2, 5), dtype=torch.float64)
    for x, need in zip((hidden, weight, bias), needs, strict=True):
        x.requires_grad_(need)
    kwargs = dict(logit_scale=1.5, softcap=2.0)
    grads = upstream((2, 5), 10), upstream((2, 5), 11)
    want = truth(hidden, weight, bias, targets, grads=grads, **kwargs)
    got = kernel(fused_linear_logprob, hidden, weight, bias, targets, grads=grads, chunk_size=3,
                 **kwargs)  # fmt: skip
    assert [g is not None for g in got[2:]] == list(needs)
    assert_matches(got, want, values=VALUE_TOL[torch.float64], grad_atol=1e-10)


@pytest.mark.parametrize("kept", [0, 1000], ids=["recompute", "kept"])
def test_gradcheck_through_the_soft_cap(monkeypatch, kept):
    """``torch.autograd.gradcheck`` in float64 (finite differences, not our own algebra) at a tiny
    shape with two vocabulary tiles, a per-token temperature and a strongly bending cap."""
    shrink_tiles(monkeypatch, 12)  # chunk_size=2: 6-column tiles, V=11 -> two tiles
    force_kept(monkeypatch, kept)
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([3, -100, 10])
    temperature = torch.tensor([0.7, 1.0, 1.4], dtype=torch.float64)

    def fn(h, w, b):
        return fused_linear_logprob(
            h, w, targets, bias=b, logit_scale=1.3, softcap=1.5, temperature=temperature,
            chunk_size=2,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_saturated_soft_cap_stays_finite_and_exact():
    """Pre-cap logits ~50x the cap: tanh saturates (slope ~0, exactly 0 in float32 for the
    largest), outputs and gradients stay finite and as accurate as float64 truth allows."""
    hidden, weight, bias, targets = make((4, 5), scale=40.0)
    kwargs = dict(softcap=5.0)
    grads = upstream((4, 5), 13, torch.float32), upstream((4, 5), 14, torch.float32)
    want = truth(hidden, weight, bias, targets, grads=grads, **kwargs)
    got = kernel(fused_linear_logprob, hidden, weight, bias, targets, grads=grads, **kwargs)
    assert max((want[0].abs().max().item(), 1.0)) < 100  # capped: |logit| <= 5
    assert_matches(got, want, values=(5e-5, 2e-5), grad_atol=1e-5)


def test_validate_false_masks_garbage_in_ignored_rows(tiles):
    """``validate=False`` computes ignored rows masked: NaN hidden rows there reach neither an
    output nor the bias gradient, and the results equal ``validate=True``'s."""
    hidden, weight, bias, targets = make((2, 5), dtype=torch.float64, ignore=[(0, 0), (1, 3)])
    with torch.no_grad():
        hidden[0, 0] = float("nan")
        hidden[1, 3] = float("inf")
    kwargs = dict(logit_scale=1.5, softcap=2.0, chunk_size=3, temperature=0.8)
    grads = upstream((2, 5), 15), upstream((2, 5), 16)
    checked = kernel(fused_linear_logprob, hidden, weight, bias, targets, grads=grads, **kwargs)
    trusted = kernel(fused_linear_logprob, hidden, weight, bias, targets, grads=grads,
                     validate=False, **kwargs)  # fmt: skip
    assert all(torch.isfinite(x).all() for x in checked + trusted if x is not None)
    assert_matches(trusted, checked, values=(1e-12, 1e-12), grad_atol=1e-12)


def test_native_16_bit_matmul_path_with_transforms(monkeypatch):
    """The CUDA path (tile matmuls on the bf16 inputs with float32 output), emulated: bias and
    scale applied to the float32 tile. Backward feeds the matmuls G rounded to bf16, so hidden and
    weight gradients get one bf16 ulp of the largest entry on top (as in test_kernel_precision);
    the bias gradient sums the float32 G and keeps the tight bound."""

    def emulated(a, b, out):
        return torch.mm(a.float(), b.float(), out=out)

    monkeypatch.setattr(linear_logprob, "_mm_fp32", emulated)
    monkeypatch.setattr(_tiles, "_mm_fp32", emulated)  # the logits tile's matmul
    monkeypatch.setattr(linear_logprob, "_use_native16", lambda h, w: h.dtype == w.dtype)
    shrink_tiles(monkeypatch, 21)
    hidden, weight, bias, targets = make((3, 5), dtype=torch.bfloat16)
    bias, kwargs = transform_kwargs("all", bias)
    grads = upstream((3, 5), 17, torch.float32), upstream((3, 5), 18, torch.float32)
    temperature = torch.rand(3, 5, generator=torch.Generator().manual_seed(19)) + 0.5
    want = truth(hidden, weight, bias, targets, grads=grads, temperature=temperature, **kwargs)
    got = kernel(fused_linear_logprob, hidden, weight, bias, targets, grads=grads,
                 temperature=temperature, chunk_size=3, **kwargs)  # fmt: skip
    assert_matches([*got[:2], None, None, got[4]], [*want[:2], None, None, want[4]],
                   values=VALUE_TOL[torch.bfloat16])  # fmt: skip
    for label, a, e in zip(("hidden.grad", "weight.grad"), got[2:4], want[2:4], strict=True):
        scale = e.abs().max().item()
        assert_close(a, e, atol=2**-8 * scale, rtol=2**-7, name=label)


BAD = [
    (dict(bias=[0.0] * V), TypeError, "bias"),
    (dict(bias=torch.zeros(V, 1)), ValueError, "bias must be \\[V\\]"),
    (dict(bias=torch.zeros(V - 1)), ValueError, "bias must be \\[V\\]"),
    (dict(bias=torch.zeros(V, dtype=torch.int64)), ValueError, "bias must be a float"),
    (dict(bias=torch.zeros(V, device="meta")), ValueError, "bias must be on"),
    (dict(logit_scale=0.0), ValueError, "logit_scale"),
    (dict(logit_scale=-1.0), ValueError, "logit_scale"),
    (dict(logit_scale=float("nan")), ValueError, "logit_scale"),
    (dict(logit_scale=True), ValueError, "logit_scale"),
    (dict(logit_scale="2"), ValueError, "logit_scale"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-30.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=torch.tensor(30.0)), ValueError, "softcap"),
]


@pytest.mark.parametrize(
    "fn", [fused_linear_logprob, reference_linear_logprob], ids=["fused", "reference"]
)
@pytest.mark.parametrize("kwargs, error, match", BAD)
def test_bad_transform_arguments_are_refused(fn, kwargs, error, match):
    hidden, weight, _, targets = make((2, 3))
    with pytest.raises(error, match=match):
        fn(hidden, weight, targets, **kwargs)
