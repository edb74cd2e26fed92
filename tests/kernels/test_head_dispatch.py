"""Which implementation of the fused lm head runs (``kernels/_dispatch.py``): the rule, the
forcing switch, the record of what ran, and that the CPU path never imports Triton.

TRL's fused path was never reached because of a version pin (TRL #7253): here the rule is
checked on CUDA tensors (``tests/device_utils.py``: CPU tensors marked as living on a GPU), and a
call on them is followed to the GPU path's row kernels (stand-ins that record their calls: Triton
cannot launch on simulated GPUs), with values equal to the eager reference.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from device_utils import simulated_cuda
from kernel_utils import GRAD_ATOL_16, assert_outputs_close, run

from microrl.kernels import (
    _dispatch,
    _row_ops,
    fused_linear_logprob,
    fused_linear_loss,
    head_implementation,
    last_implementation,
    reference_linear_logprob,
    vocab_parallel_linear_logprob,
    vocab_parallel_linear_loss,
)


def _inputs(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g, dtype=dtype).to(device)
    weight = torch.randn(11, 8, generator=g, dtype=dtype).to(device)
    targets = torch.tensor([0, 3, -100, 10, 5, 7]).to(device)
    return hidden, weight, targets


def _loss(start, end, lp, ent):
    return lp.sum(), None


CALLS = {
    "fused_linear_logprob": lambda h, w, t, **k: fused_linear_logprob(h, w, t, **k),
    "fused_linear_loss": lambda h, w, t, **k: fused_linear_loss(h, w, t, _loss, **k),
    "vocab_parallel_linear_logprob": lambda h, w, t, **k: vocab_parallel_linear_logprob(
        h, w, t, vocab_start=0, vocab_size=w.shape[0], **k
    ),
    "vocab_parallel_linear_loss": lambda h, w, t, **k: vocab_parallel_linear_loss(
        h, w, t, _loss, vocab_start=0, vocab_size=w.shape[0], **k
    ),
}


@pytest.mark.parametrize("name", CALLS)
def test_cpu_tensors_take_the_tiles_and_names_force_the_others(name):
    hidden, weight, targets = _inputs()
    assert head_implementation(hidden, weight) == "tiles"
    for forced, expected in (("auto", "tiles"), ("tiles", "tiles"), ("chunks", "chunks")):
        CALLS[name](hidden, weight, targets, implementation=forced)
        assert last_implementation() == expected, (name, forced)


@pytest.mark.parametrize("name", [*CALLS, "reference_linear_logprob"])
def test_an_unknown_implementation_is_refused_naming_the_argument(name):
    hidden, weight, targets = _inputs()
    call = CALLS.get(name, reference_linear_logprob)
    for bad in ("cuda", "Triton", None, 1):
        with pytest.raises(ValueError, match="implementation must be one of"):
            call(hidden, weight, targets, implementation=bad)


def test_cuda_tensors_take_the_gpu_path(monkeypatch):
    """Triton usable: ``"triton"``; not: ``"chunks"``; float64 (the Triton kernels compute in
    float32): ``"chunks"``; a forced name whatever the device."""
    with simulated_cuda(monkeypatch):
        hidden, weight, _ = _inputs(device="cuda")
        assert hidden.is_cuda
        monkeypatch.setattr(_dispatch, "_TRITON_OK", [True])
        assert head_implementation(hidden, weight) == "triton"
        assert head_implementation(hidden, weight, torch.zeros(11, device="cuda")) == "triton"
        assert head_implementation(hidden, weight, implementation="tiles") == "tiles"
        assert head_implementation(hidden.double(), weight) == "chunks"
        bias64 = torch.zeros(11, dtype=torch.float64, device="cuda")
        assert head_implementation(hidden, weight, bias64) == "chunks"
        monkeypatch.setattr(_dispatch, "_TRITON_OK", [False])
        assert head_implementation(hidden, weight) == "chunks"


def test_without_a_gpu_driver_triton_is_not_usable_and_says_so(monkeypatch):
    """No Triton, or Triton without a GPU driver (this machine): the torch row ops, one warning."""
    monkeypatch.setattr(_dispatch, "_TRITON_OK", [None])
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "microrl.kernels._triton_rows", raising=False)
    with pytest.warns(RuntimeWarning, match="Triton is not usable here"):
        assert _dispatch._triton_usable() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _dispatch._triton_usable() is False  # decided once per process


def test_a_call_on_cuda_tensors_runs_the_gpu_paths_kernels(monkeypatch):
    """The fast path is not silently skipped: a call on CUDA tensors runs the chunked path's row
    kernels (here the torch twins standing in for the Triton ones, recording their calls) and
    equals the eager reference; ``last_implementation`` says ``"triton"``."""
    calls = []

    class Recorder:
        TEMPS = _row_ops.TEMPS

        @staticmethod
        def stats(*args):
            calls.append("stats")
            _row_ops.stats(*args)

        @staticmethod
        def grads(*args):
            calls.append("grads")
            _row_ops.grads(*args)

    monkeypatch.setattr(_dispatch, "_TRITON_OK", [True])
    monkeypatch.setattr(_dispatch, "row_ops", lambda name: Recorder if name == "triton" else None)
    hidden, weight, targets = _inputs(torch.bfloat16)
    grads = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
    want = run(
        reference_linear_logprob, hidden.double().requires_grad_(), weight.double().requires_grad_(),
        targets, grad_lp=grads[0].double(), grad_ent=grads[1].double(),
    )  # fmt: skip
    with simulated_cuda(monkeypatch):
        got = run(
            fused_linear_logprob, hidden.cuda().requires_grad_(), weight.cuda().requires_grad_(),
            targets.cuda(), grad_lp=grads[0].cuda(), grad_ent=grads[1].cuda(),
        )  # fmt: skip
        assert got[0].is_cuda and got[2].is_cuda
        got = [t.cpu() for t in got]
    assert last_implementation() == "triton"
    assert calls == ["stats", "grads"], calls
    assert_outputs_close(got, want, values=(1e-4, 0.0), grad_atol=GRAD_ATOL_16)


def test_the_cpu_path_never_imports_triton():
    """In a fresh interpreter: importing microrl.kernels and running every fused function on CPU
    tensors (forward and backward) leaves Triton unimported."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import microrl.kernels as k

        h = torch.randn(4, 8, requires_grad=True)
        w = torch.randn(11, 8, requires_grad=True)
        t = torch.tensor([1, 2, -100, 3])
        lp, ent = k.fused_linear_logprob(h, w, t)
        (lp.sum() + ent.sum()).backward()
        k.fused_linear_loss(h, w, t, lambda s, e, lp, ent: (lp.sum(), None)).loss.backward()
        k.vocab_parallel_linear_logprob(h, w, t, vocab_start=0, vocab_size=11)[0].sum().backward()
        assert k.last_implementation() == "tiles"
        assert "triton" not in sys.modules, "the CPU path imported triton"
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
