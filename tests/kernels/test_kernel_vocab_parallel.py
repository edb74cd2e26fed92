"""vocab_parallel_linear_logprob: the vocabulary split over tensor-parallel ranks equals one device.

The reference is the single-device ``fused_linear_logprob`` on the whole (unpadded) weight, run in
the same process on the same inputs; it is itself tested against the eager definition
(test_kernel.py). Every case compares log-probs, entropy, the hidden gradient and the weight
gradient (the ranks' shard gradients concatenated), under each mix of upstream gradients: both
random, one of them an explicit zero, and one output left out of the loss entirely (autograd
then hands the Function no gradient for it, the case slime's kernel dropped).

The 2-rank checks follow tests/losses/test_whiten_distributed.py: one launch of this file
with 2 gloo ranks runs every check and writes the names of those that passed; the pytest functions
assert on them. Single-process tests cover argument errors, ``group=None``, a real process group
of one rank, and that the comparison itself catches a dropped gradient branch.

Tolerances, per compute dtype (the kernel and the reference compute the same function; only the
summation order differs: the tiles, the per-rank parts merged at the joint max, the hidden gradient
summed over ranks): float64 values within 1e-10 (observed ~1e-15), float32 values within 2e-5 as
in tests/kernels/kernel_utils.TOLERANCES (observed < 1e-6); gradients within one ulp of their dtype
relative plus 1e-5 (float32; 1e-12 for float64) of the gradient's largest entry near zero, where
the sum over the vocabulary cancels (kernel_utils.assert_outputs_close). bfloat16 inputs give
bfloat16 gradients, each rounded once from float32: within one bf16 ulp.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from kernel_utils import assert_close, assert_outputs_close  # noqa: E402
from vocab_parallel_utils import (  # noqa: E402
    TRITON,
    VALUE_TOL,
    B,
    Case,
    T,
    gpu_path_tiles,
    grad_atol,
    make_inputs,
)

from microrl.kernels import (  # noqa: E402
    fused_linear_logprob,
    vocab_parallel_linear_logprob,
)
from microrl.kernels import vocab_parallel as vp  # noqa: E402

MIXES = ("both", "lp_zero", "ent_zero", "lp_only", "ent_only")


# The 2-rank cases: even and uneven splits, a padded embedding, a rank with no real row, every
# temperature form, ignored rows with and without validation, entropy off, float32 and bf16
# inputs, several tiles and row chunks per shard, frozen inputs.
CASES = [
    Case("even", vocab=40, shard_rows=20, temperature="token", ignore=True),
    Case("uneven", vocab=37, shard_rows=19),
    Case(
        "padded_embedding", vocab=37, shard_rows=24, temperature="row", ignore=True, validate=False
    ),
    Case("padding_only_rank", vocab=15, shard_rows=16, temperature="token"),
    Case("no_entropy", vocab=37, shard_rows=19, ignore=True, with_entropy=False),
    Case("float32", vocab=37, shard_rows=19, dtype=torch.float32, temperature="token", ignore=True),
    Case("bfloat16", vocab=37, shard_rows=19, dtype=torch.bfloat16, temperature="row"),
    Case(
        "tiles",
        vocab=300,
        shard_rows=150,
        hidden=8,
        chunk_size=4,
        tiles=True,
        ignore=True,
        validate=False,
    ),
    Case("frozen_weight", vocab=37, shard_rows=19, need_w=False),
    Case("frozen_hidden", vocab=37, shard_rows=19, need_h=False, temperature="token"),
    # Head transforms: elementwise on the logits, so each rank applies them to its columns.
    Case("bias", vocab=37, shard_rows=19, bias=True, temperature="token", ignore=True),
    Case("scale_softcap", vocab=37, shard_rows=19, bias=True, logit_scale=1.7, softcap=2.5),
    Case(
        "softcap_tiles_f32",
        vocab=300,
        shard_rows=150,
        hidden=8,
        dtype=torch.float32,
        chunk_size=4,
        tiles=True,
        softcap=3.0,
        temperature="row",
    ),
    Case("softcap_no_entropy", vocab=37, shard_rows=19, softcap=2.0, with_entropy=False),
]
# The GPU path (kernels/chunked.py with a shard) on CPU tensors, with its torch row ops and,
# in the 2-rank launch, its Triton kernels under the interpreter.
_BY_NAME = {c.name: c for c in CASES}
GPU_CASES = [
    _BY_NAME[name].on("chunks")
    for name in ("even", "padded_embedding", "padding_only_rank", "no_entropy", "bfloat16",
                 "tiles", "frozen_hidden", "scale_softcap")
]  # fmt: skip
TRITON_CASES = [  # float32 (the Triton kernels compute in float32) and bf16
    dataclasses.replace(_BY_NAME[name], dtype=dtype).on("triton")
    for name, dtype in (("even", torch.float32), ("scale_softcap", torch.bfloat16),
                        ("tiles", torch.float32))
]  # fmt: skip
CASES += GPU_CASES
LAUNCH_CASES = CASES + (TRITON_CASES if TRITON else [])


def mixes(case: Case) -> tuple[str, ...]:
    return MIXES if case.with_entropy else ("both", "lp_only")


def upstream(mix: str, dtype: torch.dtype, seed: int = 1):
    """``(g_lp, g_ent)``: random (not 1, some negative), an explicit zero, or None (output unused)."""
    g = torch.Generator().manual_seed(seed)
    cdtype = torch.float64 if dtype == torch.float64 else torch.float32
    g_lp = torch.randn(B, T, generator=g, dtype=cdtype)
    g_ent = torch.randn(B, T, generator=g, dtype=cdtype)
    return {
        "both": (g_lp, g_ent),
        "lp_zero": (torch.zeros_like(g_lp), g_ent),
        "ent_zero": (g_lp, torch.zeros_like(g_ent)),
        "lp_only": (g_lp, None),
        "ent_only": (None, g_ent),
    }[mix]


def run_kernel(fn, hidden, weight, targets, mix, case, *, fresh_weight=True, **kwargs):
    """Fresh leaves, ``fn``, backward of the mix's loss: ``(lp, ent, hidden.grad, weight.grad,
    bias.grad)`` (the last None without a bias). ``fresh_weight=False``: ``weight`` (and a bias)
    are leaves already (DTensors), used as they are."""
    h = hidden.detach().clone().requires_grad_(case.need_h)
    w = weight.detach().clone().requires_grad_(case.need_w) if fresh_weight else weight
    b = kwargs.pop("bias", None)
    if b is not None and fresh_weight:
        b = b.detach().clone().requires_grad_()
    lp, ent = fn(h, w, targets, bias=b, **kwargs)
    g_lp, g_ent = upstream(mix, case.dtype)
    terms = [(lp * g_lp).sum()] if g_lp is not None else []
    if g_ent is not None and ent is not None:
        terms.append((ent * g_ent).sum())
    sum(terms).backward()
    grad_b = None if b is None else b.grad
    return lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad, grad_b


def reference(case: Case, hidden, weight, targets, mix, kwargs):
    """The single-device kernel (its CPU tiles) on the real rows of the whole weight (and bias)."""
    kwargs = _with_bias(kwargs, slice(0, case.vocab))
    kwargs = {k: v for k, v in kwargs.items() if k != "implementation"}
    return run_kernel(
        fused_linear_logprob, hidden, weight[: case.vocab], targets, mix, case, **kwargs
    )


def _with_bias(kwargs: dict, rows: slice) -> dict:
    """``kwargs`` with the bias (if any) cut to ``rows``."""
    if kwargs.get("bias") is None:
        return kwargs
    return {**kwargs, "bias": kwargs["bias"][rows]}


def assert_matches(case: Case, got, want, what: str) -> None:
    """Values and the hidden / weight gradients; the bias gradients too when both runs have one
    (the 5th entry, gathered and cut to the real vocabulary by the caller)."""
    cdtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    assert_outputs_close(
        got[:4], want[:4], values=VALUE_TOL[cdtype], grad_atol=grad_atol(case), name=what
    )
    if len(got) > 4 and got[4] is not None:
        assert want[4] is not None, f"{what}: a bias gradient without a reference"
        scale = want[4].double().abs().max().item()
        eps = torch.finfo(got[4].dtype).eps
        assert_close(
            got[4], want[4], atol=grad_atol(case) * scale, rtol=eps, name=f"{what} bias.grad"
        )


@contextlib.contextmanager
def comm_log():
    """Records ``(op, numel)`` of every ``dist.all_reduce`` (and refuses any other collective)
    inside the block: the kernel's communication is the reductions of O(N) statistics (forward)
    and of the ``[N, H]`` hidden gradient (backward), nothing with a vocabulary dimension."""
    calls: list[tuple[str, int]] = []
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")
    saved = {name: getattr(dist, name) for name in names}

    def recorded(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append(({dist.ReduceOp.MAX: "MAX", dist.ReduceOp.SUM: "SUM"}[op], tensor.numel()))
        return saved["all_reduce"](tensor, op=op, group=group, async_op=async_op)

    def refused(*args, **kwargs):
        raise AssertionError("the kernel may only all_reduce")

    for name in names:
        setattr(dist, name, recorded if name == "all_reduce" else refused)
    try:
        yield calls
    finally:
        for name, value in saved.items():
            setattr(dist, name, value)


def expected_comm(case: Case, targets: torch.Tensor) -> list[tuple[str, int]]:
    """Forward: the row max of M rows, then [S, (A,) z_t - m] stacked; backward: the [M, H]
    hidden gradient when hidden requires grad. M: the non-ignored rows (all rows without
    validation, whose rows are masked instead of compacted)."""
    m = int((targets != -100).sum()) if case.validate else targets.numel()
    calls = [("MAX", m), ("SUM", (3 if case.with_entropy else 2) * m)]
    if case.need_h:
        calls.append(("SUM", m * case.hidden))
    return calls


def check_case(case: Case, mix: str, rank: int, world: int, group, log: bool = False) -> None:
    """Rank ``rank`` of ``world`` (``group`` may be None for a world of one): its shard's outputs
    and gradients against the single-device kernel; the gathered weight gradient too. ``log``:
    also check the collectives of the kernel's forward and backward (``expected_comm``)."""
    hidden, weight, targets, kwargs = make_inputs(case, world)
    start = rank * case.shard_rows
    rows = slice(start, start + case.shard_rows)
    with comm_log() if log else contextlib.nullcontext([]) as calls:
        got = run_kernel(
            vocab_parallel_linear_logprob,
            hidden,
            weight[rows],
            targets,
            mix,
            case,
            group=group,
            vocab_start=start,
            vocab_size=case.vocab,
            **_with_bias(kwargs, rows),
        )
    if log:
        assert calls == expected_comm(case, targets), (case.name, mix, calls)
    want = reference(case, hidden, weight, targets, mix, kwargs)
    grad_w, grad_b = (_gathered(g, case, start, world) for g in got[3:5])
    assert_matches(case, (*got[:3], grad_w, grad_b), want, f"{case.name}[{mix}]")
    assert (got[4] is not None) == case.bias, f"{case.name}[{mix}]: bias .grad presence"
    # No branch dropped: a loss on one output still moves both inputs.
    for grad, need in ((got[2], case.need_h), (got[3], case.need_w)):
        assert (grad is not None) == need, f"{case.name}[{mix}]: .grad presence"
    for grad in (got[2], grad_w):
        if grad is not None:
            assert grad.abs().max() > 1e-3, f"{case.name}[{mix}]: gradient vanished"


def _gathered(grad, case: Case, start: int, world: int):
    """A shard's gradient (weight or bias) gathered over the ranks and cut to the real rows;
    padding rows never enter the softmax: their gradient is exactly zero (their values NaN)."""
    if grad is None:
        return None
    assert (grad[max(0, case.vocab - start) :] == 0).all(), f"{case.name}: padding grad"
    if world > 1:
        parts = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(parts, grad.contiguous())
        grad = torch.cat(parts)
    return grad[: case.vocab]


# ============================================================================ single process


@pytest.mark.usefixtures("intra_op_threads")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_no_group_equals_single_device(case, monkeypatch):
    """``group=None`` (no tensor parallelism): the whole vocabulary in one padded shard."""
    if case.tiles:
        monkeypatch.setattr(vp, "_TILE_ELEMENTS", 4 * 64)
        monkeypatch.setattr(vp, "_MIN_VOCAB_TILE", 1)
    whole = dataclasses.replace(case, shard_rows=case.shard_rows * 2)
    with gpu_path_tiles(whole):
        for mix in mixes(whole):
            check_case(whole, mix, rank=0, world=1, group=None)


@pytest.fixture
def world_of_one(tmp_path):
    """A real gloo process group of one rank in this process, torn down afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=lambda c: c.name)
def test_world_of_one_equals_single_device_and_communicates_statistics(case, world_of_one):
    for mix in mixes(case):
        check_case(
            dataclasses.replace(case, shard_rows=case.shard_rows * 2),
            mix,
            rank=0,
            world=1,
            group=world_of_one,
            log=True,
        )


def test_dtensor_weight_on_a_world_of_one(world_of_one):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    case = Case("dtensor", vocab=37, shard_rows=40)
    hidden, weight, targets, kwargs = make_inputs(case, 1)
    mesh = init_device_mesh("cpu", (1,))
    leaf = distribute_tensor(weight[:40].clone(), mesh, [Shard(0)]).requires_grad_()
    got = run_kernel(
        vocab_parallel_linear_logprob, hidden, leaf, targets, "both", case, fresh_weight=False,
        vocab_size=37, **kwargs,
    )  # fmt: skip
    want = reference(case, hidden, weight, targets, "both", kwargs)
    grad_w = got[3].full_tensor()
    assert (grad_w[37:] == 0).all()
    assert_matches(case, (*got[:3], grad_w[:37]), want, "dtensor")
    replicated = distribute_tensor(weight[:37].clone(), mesh, [Replicate()])
    with pytest.raises(ValueError, match="Shard\\(0\\)"):
        vocab_parallel_linear_logprob(hidden, replicated, targets)
    with pytest.raises(ValueError, match="come from a DTensor"):
        vocab_parallel_linear_logprob(hidden, leaf, targets, group=world_of_one)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_linear_logprob(hidden, leaf, targets, vocab_size=41)
    with pytest.raises(ValueError, match="hidden must be a plain"):
        vocab_parallel_linear_logprob(distribute_tensor(hidden, mesh, [Replicate()]), leaf, targets)


@pytest.mark.parametrize("dropped", ["logprobs", "entropy"])
def test_the_comparison_catches_a_dropped_gradient_branch(dropped, monkeypatch):
    """Sensitivity of the checks above: a backward that drops one output's gradient (slime's bug:
    a gradient that arrives as None is skipped) fails the mix that uses only that output."""
    real = vp._backward

    def dropping(saved, plan, need, grad_logprob, grad_entropy):
        if dropped == "logprobs":
            grad_logprob = None
        else:
            grad_entropy = None
        return real(saved, plan, need, grad_logprob, grad_entropy)

    monkeypatch.setattr(vp, "_backward", dropping)
    case = Case("drop", vocab=37, shard_rows=37)
    mix = "lp_only" if dropped == "logprobs" else "ent_only"
    with pytest.raises(AssertionError):
        check_case(case, mix, rank=0, world=1, group=None)
    monkeypatch.setattr(vp, "_backward", real)
    check_case(case, mix, rank=0, world=1, group=None)


def test_argument_errors():
    hidden, weight, targets, _ = make_inputs(Case("errors", vocab=37, shard_rows=20), 2)
    shard = weight[20:]  # global rows 20..39: 17 real, 3 padding
    ok = dict(group=None, vocab_start=0, vocab_size=37)
    with pytest.raises(TypeError, match="ProcessGroup or None"):
        vocab_parallel_linear_logprob(hidden, weight, targets, **{**ok, "group": "tp"})
    for bad in (None, -1, 1.0, True):
        with pytest.raises(ValueError, match="vocab_start"):
            vocab_parallel_linear_logprob(hidden, weight, targets, **{**ok, "vocab_start": bad})
    for bad in (None, 0, 2.0):
        with pytest.raises(ValueError, match="vocab_size"):
            vocab_parallel_linear_logprob(hidden, weight, targets, **{**ok, "vocab_size": bad})
    with pytest.raises(ValueError, match="group=None means no tensor parallelism"):
        vocab_parallel_linear_logprob(
            hidden, shard, targets, group=None, vocab_start=20, vocab_size=37
        )
    with pytest.raises(ValueError, match="group=None means no tensor parallelism"):
        vocab_parallel_linear_logprob(hidden, weight[:20], targets, **ok)
    # Targets are checked against the whole vocabulary: 38 is out of range although the
    # (padded) weight has 40 rows; an ignored position's temperature is never used.
    bad_targets = targets.clone()
    bad_targets[0, 0] = 38
    with pytest.raises(ValueError, match=r"\[0, 37\).*found 38"):
        vocab_parallel_linear_logprob(hidden, weight, bad_targets, **ok)
    temperature = torch.ones(B, T)
    temperature[1, 1] = 0.0
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        vocab_parallel_linear_logprob(hidden, weight, targets, temperature=temperature, **ok)
    ignored = targets.clone()
    ignored[1, 1] = -100
    lp, _ = vocab_parallel_linear_logprob(hidden, weight, ignored, temperature=temperature, **ok)
    assert lp[1, 1] == 0 and torch.isfinite(lp).all()
    # The single-device checks (shapes, dtypes, flags) apply as they are.
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_linear_logprob(hidden, weight, targets[:, :2], **ok)
    with pytest.raises(ValueError, match="with_entropy"):
        vocab_parallel_linear_logprob(hidden, weight, targets, with_entropy=1, **ok)
    with pytest.raises(TypeError, match=r"weight must be a torch\.Tensor"):
        vocab_parallel_linear_logprob(hidden, weight.tolist(), targets, **ok)


def test_all_positions_ignored_gives_zeros():
    hidden, weight, targets, _ = make_inputs(Case("ignored", vocab=37, shard_rows=40), 1)
    for validate in (True, False):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        lp, ent = vocab_parallel_linear_logprob(
            h, w, torch.full_like(targets, -100), vocab_start=0, vocab_size=37, validate=validate
        )
        (lp.sum() + ent.sum()).backward()
        for t in (lp, ent, h.grad, w.grad):
            assert_close(t, torch.zeros_like(t), atol=0, rtol=0, name=f"{validate=}")


# ============================================================================ two ranks


@pytest.fixture(scope="module")
def two_rank_checks(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from distributed_utils import launch  # imports transformers: only where a launch is needed

    tmp = tmp_path_factory.mktemp("vocab_parallel")
    launch(2, HERE, str(tmp), timeout=120)
    passed = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    assert passed[0] == passed[1], passed
    return passed[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_equal_one_device_for_every_upstream_gradient_mix(two_rank_checks):
    expected = [f"{c.name}[{m}]" for c in LAUNCH_CASES for m in mixes(c)]
    got = [c for c in two_rank_checks if not c.startswith(("comm[", "dtensor["))]
    assert sorted(got) == sorted(expected)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_never_drop_an_unused_outputs_gradient(two_rank_checks):
    """Only the entropy in the loss (logprobs unused) or only the log-probs: the hidden and weight
    gradients are non-zero and equal the single-device ones (checked in ``check_case``)."""
    for case in LAUNCH_CASES:
        if case.with_entropy:
            assert {f"{case.name}[lp_only]", f"{case.name}[ent_only]"} <= set(two_rank_checks)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_communicate_statistics_only(two_rank_checks):
    """Every call's all_reduces are exactly [M] (max), [3M] or [2M] (sums) and, in backward, the
    [M, H] hidden gradient: never a tensor with a vocabulary dimension."""
    assert sorted(c for c in two_rank_checks if c.startswith("comm[")) == sorted(
        f"comm[{c.name}]" for c in LAUNCH_CASES
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_dtensor_weight(two_rank_checks):
    assert {f"dtensor[{v}]" for v in DTENSOR} <= set(two_rank_checks)


# DTensor variants: (rows of the DTensor, real vocab_size or None, local rows on ranks 0 and 1).
DTENSOR = {
    "uneven": (37, None, (19, 18)),  # torch.chunk's split
    "padded": (40, 37, (20, 20)),  # rows 37..39 are padding
    "empty_rank": (1, None, (1, 0)),  # rank 1 holds no row at all
}


def check_dtensor(rank: int, variant: str) -> None:
    """A ``Shard(0)`` DTensor weight: its gradient is a ``Shard(0)`` DTensor whose full tensor is
    the single-device weight gradient (0 on padding rows)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    rows, vocab_size, local_rows = DTENSOR[variant]
    vocab = vocab_size or rows
    # The uneven split also carries a Shard(0) bias and soft-capping (Gemma-style heads).
    transforms = dict(bias=True, softcap=2.0) if variant == "uneven" else {}
    case = Case(
        "dtensor", vocab=vocab, shard_rows=rows, temperature="token", ignore=True, **transforms
    )
    hidden, weight, targets, kwargs = make_inputs(case, 1)
    mesh = init_device_mesh("cpu", (2,))
    leaf = distribute_tensor(weight[:rows].clone(), mesh, [Shard(0)]).requires_grad_()
    assert leaf.to_local().shape[0] == local_rows[rank]
    extra = {} if vocab_size is None else dict(vocab_size=vocab_size)
    if case.bias:
        bias = kwargs["bias"][:rows].clone()
        extra["bias"] = distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_()
        with pytest.raises(ValueError, match="bias must be a DTensor"):
            vocab_parallel_linear_logprob(hidden, leaf, targets, bias=bias)
    plain = {"bias": kwargs.pop("bias")} if case.bias else {}
    got = run_kernel(
        vocab_parallel_linear_logprob, hidden, leaf, targets, "both", case, fresh_weight=False,
        **extra, **kwargs,
    )  # fmt: skip
    assert tuple(got[3].placements) == (Shard(0),)
    grad_w = got[3].full_tensor()
    assert (grad_w[vocab:] == 0).all()
    grad_b = None
    if case.bias:
        assert tuple(got[4].placements) == (Shard(0),)
        grad_b = got[4].full_tensor()[:vocab]
    want = reference(case, hidden, weight, targets, "both", {**kwargs, **plain})
    assert_matches(case, (*got[:3], grad_w[:vocab], grad_b), want, f"dtensor[{variant}]")


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels on CPU tensors
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    passed = []
    for case in LAUNCH_CASES:
        tile = vp._TILE_ELEMENTS, vp._MIN_VOCAB_TILE
        if case.tiles:  # 64-column tiles: 150 rows per shard = 64 + 64 + 22
            vp._TILE_ELEMENTS, vp._MIN_VOCAB_TILE = 4 * 64, 1
        try:
            with gpu_path_tiles(case):
                for mix in mixes(case):
                    check_case(case, mix, rank, world, dist.group.WORLD, log=True)
                    passed.append(f"{case.name}[{mix}]")
        finally:
            vp._TILE_ELEMENTS, vp._MIN_VOCAB_TILE = tile
        passed.append(f"comm[{case.name}]")
    for variant in DTENSOR:
        check_dtensor(rank, variant)
        passed.append(f"dtensor[{variant}]")
    dist.barrier()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
