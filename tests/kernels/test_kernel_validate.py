"""``fused_linear_logprob(validate=False)``: the same results as ``validate=True``, with no host sync.

``validate=True`` reads the target-range check, the temperature check and the non-ignored row count
back in one sync and computes only the non-ignored rows; ``validate=False`` reads nothing and
computes every row with the ignored ones masked. Garbage at ignored positions (NaN/inf hidden
states, NaN upstream gradients, non-positive temperatures) must reach neither path's results.
"""

from __future__ import annotations

import collections

import pytest
import torch
from kernel_utils import TOLERANCES, assert_close, assert_outputs_close, run, shrink_tiles
from torch.utils._python_dispatch import TorchDispatchMode

from microrl.kernels import fused_linear_logprob, reference_linear_logprob

H, V = 16, 50
NAMES = ("logprobs", "entropy", "hidden.grad", "weight.grad")
# Ops that copy a device value to the host (what torch.cuda.set_sync_debug_mode would flag).
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "item"}


class _Syncs(TorchDispatchMode):
    """Counts host-sync ops dispatched inside the ``with`` block (backward included: on CPU the
    autograd engine runs it on the calling thread, under this mode). ``Tensor.tolist`` of a CPU
    tensor reads memory without any dispatch, so it is counted by a wrapper instead."""

    def __init__(self, monkeypatch) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.ops["tolist"] += 1
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _SYNC_OPS:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tiles(monkeypatch):
    shrink_tiles(monkeypatch, 21)  # 7-column vocabulary tiles with chunk_size=3


def _poisoned_inputs(dtype, seed=0):
    """[3, 5] positions, a third of them ignored; garbage at every ignored position."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 5, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    targets = torch.randint(0, V, (3, 5), generator=g)
    ignored = torch.zeros(3, 5, dtype=torch.bool)
    ignored[0, 0] = ignored[0, 4] = ignored[1, 2] = ignored[2, 0] = ignored[2, 3] = True
    targets[ignored] = -100
    hidden[0, 0] = float("nan")
    hidden[1, 2] = float("inf")
    hidden[2, 3] = -float("inf")
    temperature = torch.rand(3, 5, generator=g, dtype=torch.float64) + 0.5
    odtype = torch.float64 if dtype == torch.float64 else torch.float32
    grad_lp = torch.randn(3, 5, generator=g, dtype=odtype).masked_fill(ignored, float("nan"))
    grad_ent = torch.randn(3, 5, generator=g, dtype=odtype).masked_fill(ignored, float("nan"))
    return hidden.requires_grad_(), weight.requires_grad_(), targets, temperature, grad_lp, grad_ent


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token_temperature", [False, True], ids=["scalar-T", "tensor-T"])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_validate_false_equals_validate_true(tiles, dtype, per_token_temperature, with_entropy):
    hidden, weight, targets, temperature, grad_lp, grad_ent = _poisoned_inputs(dtype)
    if per_token_temperature:
        # Ignored positions' temperatures are not validated by a caller that skips validation:
        # a garbage one there must not matter (validate=True needs them > 0, so it gets 1).
        trusted = temperature.masked_fill(targets == -100, 1.0)
        garbage = temperature.masked_fill(targets == -100, float("nan"))
    else:
        trusted = garbage = 0.7
    kwargs = {"chunk_size": 3, "with_entropy": with_entropy, "grad_lp": grad_lp}
    kwargs["grad_ent"] = grad_ent
    checked = run(fused_linear_logprob, hidden, weight, targets, temperature=trusted, **kwargs)
    trusting = run(
        fused_linear_logprob, hidden, weight, targets, temperature=garbage, validate=False, **kwargs
    )
    # Same arithmetic on the non-ignored rows (the masked rows only add zero terms; bf16 inputs
    # are upcast, so the values are float32 ones), so equal to the compute dtype's rounding of a
    # different chunking; bf16 gradients within one rounding to bf16 (assert_outputs_close).
    values = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    assert_outputs_close(trusting, checked, values=values, name=f"{dtype}")
    ignored = targets == -100
    assert not trusting[0][ignored].any() and not trusting[2][ignored].any()


def test_validate_false_matches_reference(tiles):
    """Against the eager reference on clean inputs (hidden 0 at the ignored positions)."""
    hidden, weight, targets, _, grad_lp, grad_ent = _poisoned_inputs(torch.float64)
    clean = torch.where((targets == -100).unsqueeze(-1), 0.0, hidden.detach()).requires_grad_()
    kwargs = {"chunk_size": 3, "temperature": 1.3, "grad_lp": grad_lp, "grad_ent": grad_ent}
    got = run(fused_linear_logprob, hidden, weight, targets, validate=False, **kwargs)
    want = run(reference_linear_logprob, clean, weight, targets, **kwargs)
    for name, a, e in zip(NAMES, got, want, strict=True):
        assert_close(a, e, atol=1e-10, rtol=1e-9, name=name)


def test_validate_false_zero_dim_temperature_tensor():
    """A 0-dim temperature tensor cannot be read without a sync: it is used as a tensor instead."""
    hidden, weight, targets, _, _, _ = _poisoned_inputs(torch.float64)
    temperature = torch.tensor(0.8, dtype=torch.float64)
    got = fused_linear_logprob(hidden, weight, targets, temperature=temperature, validate=False)
    want = fused_linear_logprob(hidden, weight, targets, temperature=temperature)
    for name, a, e in zip(NAMES, got, want, strict=False):
        assert_close(a, e, atol=1e-12, rtol=1e-12, name=name)


@pytest.mark.parametrize("per_token_temperature", [False, True], ids=["scalar-T", "tensor-T"])
@pytest.mark.parametrize("validate, most", [(True, 1), (False, 0)], ids=["validate", "trusted"])
def test_host_syncs_per_call(tiles, monkeypatch, per_token_temperature, validate, most):
    """Forward + backward: one host sync with validation (checks and row count read together),
    none without; the entropy gradient's all-zero case is not probed (that would be one)."""
    hidden, weight, targets, temperature, _, _ = _poisoned_inputs(torch.float32)
    hidden = torch.nan_to_num(hidden.detach()).requires_grad_()
    temp = temperature if per_token_temperature else torch.tensor(0.9)
    for ent_in_loss in (True, False):
        with _Syncs(monkeypatch) as syncs:
            run(
                fused_linear_logprob, hidden, weight, targets, chunk_size=3, temperature=temp,
                validate=validate, grad_ent=1.0 if ent_in_loss else None,
            )  # fmt: skip
        assert sum(syncs.ops.values()) == most, f"{ent_in_loss=}: {dict(syncs.ops)}"


def test_validate_must_be_bool():
    hidden, weight, targets, _, _, _ = _poisoned_inputs(torch.float32)
    with pytest.raises(ValueError, match="validate"):
        fused_linear_logprob(hidden, weight, targets, validate=1)


def test_validate_true_still_rejects_bad_values():
    """The single-sync check still names the bad value (targets) or argument (temperature)."""
    hidden, weight, targets, temperature, _, _ = _poisoned_inputs(torch.float32)
    hidden = torch.nan_to_num(hidden.detach())
    bad = targets.clone()
    bad[1, 1] = V
    with pytest.raises(ValueError, match=f"found {V}"):
        fused_linear_logprob(hidden, weight, bad)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprob(hidden, weight, targets, temperature=temperature - 1.0)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprob(hidden, weight, targets, temperature=torch.tensor(-1.0))
