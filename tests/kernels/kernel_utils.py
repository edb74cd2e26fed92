"""Shared helpers for the fused lm-head kernel tests: run a kernel, compare with worst-element messages."""

from __future__ import annotations

from collections.abc import Callable

import torch

from microrl.kernels import linear_logprob

# Tolerances per dtype for the kernel against the eager reference computed in the same dtype.
# float64: both are exact up to summation order. float32: logits of size O(1..10) summed over
# H <= 64 and V <= 100 terms in a different order differ by a few ulps of the largest term.
TOLERANCES = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 2e-5)}


def assert_outputs_close(got, want, *, values=(2e-5, 2e-5), grad_atol=1e-5, name="") -> None:
    """``(logprobs, entropy, hidden.grad, weight.grad)`` of two runs of the same math.

    Values (float32 or float64, whatever the input dtypes) within ``values = (atol, rtol)``.
    Gradients ``got`` come back in their input's dtype, each rounded once from the compute dtype
    (``want`` may be float64 truth): one ulp of ``got``'s dtype relative (rounding is within half an ulp; the other half covers the compute
    dtype's own error moving a value across a rounding boundary), plus ``grad_atol`` times the
    gradient's largest entry for entries near zero, where the sum over the vocabulary cancels and
    leaves an absolute float32 error of ~1e-7..1e-6 of that scale.
    """
    names = ("logprobs", "entropy", "hidden.grad", "weight.grad")
    for label, a, e in zip(names, got, want, strict=True):
        full = f"{name} {label}".strip()
        if label.endswith("grad") and a is not None and e is not None:
            scale = e.detach().double().abs().max().item() if e.numel() else 0.0
            rtol = torch.finfo(a.dtype).eps
            assert_close(a, e, atol=grad_atol * scale, rtol=rtol, name=full)
        else:
            assert_close(a, e, atol=values[0], rtol=values[1], name=full)


def assert_close(actual, expected, *, atol: float, rtol: float, name: str) -> None:
    """``|actual - expected| <= atol + rtol * |expected|`` everywhere; the message shows the worst."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{name}: {actual=} but {expected=}"
        return
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), (
        f"{name}: non-finite values at {(~torch.isfinite(a)).nonzero()[:5].tolist()}"
    )
    excess = (a - e).abs() - (atol + rtol * e.abs())
    if a.numel() == 0 or excess.max() <= 0:
        return
    worst = int(excess.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
    raise AssertionError(
        f"{name}: worst element at {where}: got {a.reshape(-1)[worst].item():.10g}, expected "
        f"{e.reshape(-1)[worst].item():.10g} (|diff| {abs(a.reshape(-1)[worst] - e.reshape(-1)[worst]).item():.3g}, "
        f"atol {atol}, rtol {rtol}); {(excess > 0).sum().item()} of {a.numel()} elements out"
    )


def run(
    fn: Callable,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    grad_lp: torch.Tensor | float | None = 1.0,
    grad_ent: torch.Tensor | float | None = 1.0,
    **kwargs,
):
    """Run ``fn`` on fresh leaves cloned from ``hidden``/``weight`` (keeping their requires_grad and
    strides via ``make``), backprop ``sum(grad_lp * logprobs) + sum(grad_ent * entropy)``.

    A ``None`` upstream weight leaves that output out of the loss entirely, so autograd hands the
    kernel a missing (``None``) gradient for it. Returns ``(logprobs, entropy, hidden.grad,
    weight.grad)``.
    """
    h = hidden.detach().clone().requires_grad_(hidden.requires_grad)
    w = weight.detach().clone().requires_grad_(weight.requires_grad)
    logprobs, entropy = fn(h, w, targets, **kwargs)
    terms = []
    if grad_lp is not None:
        terms.append((logprobs * grad_lp).sum())
    if grad_ent is not None and entropy is not None:
        terms.append((entropy * grad_ent).sum())
    if terms and (h.requires_grad or w.requires_grad):
        sum(terms).backward()
    return logprobs.detach(), None if entropy is None else entropy.detach(), h.grad, w.grad


def compare(fn, ref, hidden, weight, targets, *, atol, rtol, prepare=None, **kwargs) -> None:
    """Outputs and gradients of ``fn`` equal those of ``ref`` (names say which one differs).

    ``prepare`` maps the cloned leaf hidden to the tensor the kernels see (e.g. a transpose), so
    gradients are compared on the leaf.
    """
    names = ("logprobs", "entropy", "hidden.grad", "weight.grad")
    if prepare is not None:
        kwargs_fn = _with_prepare(fn, prepare)
        kwargs_ref = _with_prepare(ref, prepare)
    else:
        kwargs_fn, kwargs_ref = fn, ref
    got = run(kwargs_fn, hidden, weight, targets, **kwargs)
    want = run(kwargs_ref, hidden, weight, targets, **kwargs)
    for name, a, e in zip(names, got, want, strict=True):
        assert_close(a, e, atol=atol, rtol=rtol, name=name)


def _with_prepare(fn, prepare):
    def wrapped(h, w, t, **kwargs):
        return fn(prepare(h), w, t, **kwargs)

    return wrapped


def shrink_tiles(monkeypatch, tile_elements: int) -> None:
    """Make the kernel tile the vocabulary at test sizes (tile = tile_elements // rows columns)."""
    monkeypatch.setattr(linear_logprob, "WORKING_TILE_ELEMENTS", tile_elements)
    monkeypatch.setattr(linear_logprob, "_MIN_VOCAB_TILE", 1)


# The GPU path's 16-bit GEMMs take the logit gradient rounded to the input dtype (2**-9 relative
# per entry, float32 accumulation), so its hidden and weight gradients carry an absolute error of
# ~2**-9 of the largest one where the sum over the vocabulary cancels (observed <= 2**-8.3 at
# V=70, bf16): 2**-7 of the largest entry leaves room, as the GPU check's kernel step does.
GRAD_ATOL_16 = 2**-7


def fixed_tiles(monkeypatch, rows: int, cols: int) -> None:
    """Make the chunked (GPU) path use ``rows x cols`` tiles whatever its budget and cost model
    say (``kernels/_chunk_plan.plan_tiles``), to exercise several row blocks and column slices
    at test sizes."""
    from microrl.kernels import _chunk_plan

    def plan(problem, *, temps=0, **_):
        return _chunk_plan.ChunkPlan(rows, cols, temps)

    monkeypatch.setattr(_chunk_plan, "plan_tiles", plan)


def interpreted_triton():
    """The Triton row kernels built for Triton's interpreter, so that ``implementation="triton"``
    runs them on CPU tensors. Only in a process started with ``TRITON_INTERPRET=1``: Triton reads
    it when its own modules are imported, so it cannot be switched on in a process that imported
    Triton already (test_triton_rows.py starts one for tests/kernels/triton_interpreted.py)."""
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "start the process with TRITON_INTERPRET=1"
    from microrl.kernels import _triton_rows

    return _triton_rows
