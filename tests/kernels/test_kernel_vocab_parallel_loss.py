"""vocab_parallel_linear_loss: the fused loss path with the vocabulary split over tensor-parallel ranks.

The reference is the single-device ``fused_linear_loss`` on the whole (unpadded) weight, in the
same process, on the same inputs (itself tested against the kernel + loss path in
test_fused_loss.py). Compared: the loss, log-probs, entropy, and the hidden, weight and bias
gradients (shards gathered), for the splits and head variants of test_kernel_vocab_parallel.py
(even, uneven, padding-only rank, bias + scale + soft-capping, several tiles with groups that do
not fit the tile budget, frozen weight). The loss is a per-sequence function of log-probs and
entropy (a GRPO-like weighted sum), so groups follow the sequence boundaries. Tolerances as in
that file (fp64: 1e-10; fp32: 2e-5 values, gradients 1e-5 of their largest entry).
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
from kernel_utils import assert_close  # noqa: E402
from vocab_parallel_utils import (  # noqa: E402
    TRITON,
    VALUE_TOL,
    Case,
    gpu_path_tiles,
    grad_atol,
    make_inputs,
)

from microrl.kernels import fused_linear_loss, fused_loss, linear_logprob  # noqa: E402
from microrl.kernels.vocab_parallel_loss import vocab_parallel_linear_loss  # noqa: E402

B, T = 3, 5
SEGMENTS = [0, 5, 10, 15]  # the three sequences of the [3, 5] inputs
LOSS_CASES = [
    Case("even", vocab=40, shard_rows=20, temperature="token", ignore=True),
    Case("uneven", vocab=37, shard_rows=19, dtype=torch.float32),
    Case("padding_only_rank", vocab=15, shard_rows=16, temperature="row"),
    Case("head_transforms", vocab=37, shard_rows=19, bias=True, logit_scale=1.3, softcap=2.5),
    Case("tiles", vocab=300, shard_rows=150, hidden=8, chunk_size=4, tiles=True, ignore=True),
    Case("frozen_weight", vocab=37, shard_rows=19, need_w=False, bias=True),
]
# The GPU path (kernels/chunked_loss.py): each group kept in one tile (the default budget at
# these sizes), or recomputed in 4-row by 64-column tiles ("tiles"); its torch row ops, and in
# the 2-rank launch its Triton kernels under the interpreter (float32: they compute in it).
GPU_LOSS_CASES = [case.on("chunks") for case in LOSS_CASES]
TRITON_LOSS_CASES = [
    dataclasses.replace(case, dtype=torch.float32).on("triton")
    for case in LOSS_CASES
    if case.name in ("even", "head_transforms", "tiles")
]
LOSS_CASES += GPU_LOSS_CASES
LAUNCH_CASES = LOSS_CASES + (TRITON_LOSS_CASES if TRITON else [])


def loss_fn_for(adv: torch.Tensor, with_entropy: bool):
    """``loss_fn(start, end, lp, ent)``: ``-sum(adv * lp) + 0.1 * sum(|adv| * ent)`` on the rows."""

    def loss_fn(start, end, lp, ent):
        loss = -(adv[start:end].to(lp.dtype) * lp).sum()
        if with_entropy and ent is not None:
            loss = loss + 0.1 * (adv[start:end].abs().to(ent.dtype) * ent).sum()
        return loss, (start, end)

    return loss_fn


def run(fn, case: Case, hidden, weight, bias, targets, kwargs, **extra):
    """Fresh leaves, ``fn`` (a fused loss), ``loss.backward()``: values and gradients."""
    h = hidden.detach().clone().requires_grad_(case.need_h)
    w = weight.detach().clone().requires_grad_(case.need_w)
    b = None if bias is None else bias.detach().clone().requires_grad_()
    adv = torch.randn(B * T, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kw = {k: v for k, v in kwargs.items() if k != "bias"}
    out = fn(
        h, w, targets, loss_fn_for(adv, case.with_entropy), segments=SEGMENTS, bias=b, **kw, **extra
    )
    out.loss.backward()
    # Groups: consecutive, covering every row, never splitting a sequence.
    bounds = [out.aux[0][0]] + [end for _, end in out.aux]
    assert bounds[0] == 0 and bounds[-1] == B * T and set(bounds) <= set(SEGMENTS), out.aux
    return (
        out.loss.detach(),
        out.logprobs,
        out.entropy,
        h.grad,
        w.grad,
        None if b is None else b.grad,
    )


def check_loss_case(case: Case, rank: int, world: int, group) -> None:
    hidden, weight, targets, kwargs = make_inputs(case, world)
    bias = kwargs.get("bias")
    start = rank * case.shard_rows
    rows = slice(start, start + case.shard_rows)
    got = run(
        vocab_parallel_linear_loss, case, hidden, weight[rows], None if bias is None else bias[rows],
        targets, kwargs, group=group, vocab_start=start, vocab_size=case.vocab,
    )  # fmt: skip
    plain = {k: v for k, v in kwargs.items() if k != "implementation"}  # the CPU tiles
    want = run(
        fused_linear_loss, case, hidden, weight[: case.vocab],
        None if bias is None else bias[: case.vocab], targets, plain,
    )  # fmt: skip
    cdtype = torch.float64 if case.dtype == torch.float64 else torch.float32
    atol, rtol = VALUE_TOL[cdtype]
    for label, a, e in zip(("loss", "logprobs", "entropy"), got[:3], want[:3], strict=True):
        assert_close(a, e, atol=atol, rtol=rtol, name=f"{case.name} {label}")
    labels = ("hidden.grad", "weight.grad", "bias.grad")
    for label, a, e in zip(labels, got[3:], want[3:], strict=True):
        if label != "hidden.grad" and a is not None:
            assert (a[max(0, case.vocab - start) :] == 0).all(), f"{case.name}: padding {label}"
            if world > 1:
                parts = [torch.empty_like(a) for _ in range(world)]
                dist.all_gather(parts, a.contiguous())
                a = torch.cat(parts)
            a = a[: case.vocab]
        if a is None or e is None:
            assert a is None and e is None, f"{case.name}: {label} presence"
            continue
        scale = e.double().abs().max().item()
        eps = torch.finfo(a.dtype).eps
        assert_close(a, e, atol=grad_atol(case) * scale, rtol=eps, name=f"{case.name} {label}")


@contextlib.contextmanager
def small_tiles(case: Case):
    """For ``case.tiles``: 64-column tiles (150 real rows per shard = 64 + 64 + 22) and a tile
    budget of 1024 elements, so a 5-row sequence runs as two 3-row chunks with 3 of its 6 tiles
    kept and 3 recomputed in the gradient pass."""
    names = [(linear_logprob, "WORKING_TILE_ELEMENTS"), (linear_logprob, "_MIN_VOCAB_TILE")]
    names.append((fused_loss, "WORKING_TILE_ELEMENTS"))
    saved = [getattr(m, n) for m, n in names]
    if case.tiles:
        for (module, name), value in zip(names, (4 * 64, 1, 4 * 64), strict=True):
            setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in zip(names, saved, strict=True):
            setattr(module, name, value)


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: c.name)
def test_no_group_equals_single_device(case):
    """``group=None``: the whole vocabulary in one (padded) shard."""
    with small_tiles(case), gpu_path_tiles(case):
        check_loss_case(dataclasses.replace(case, shard_rows=case.shard_rows * 2), 0, 1, None)


def test_bad_loss_fn_and_segments_are_refused():
    case = LOSS_CASES[0]
    hidden, weight, targets, kwargs = make_inputs(case, 2)  # the whole vocabulary, 40 rows
    kw = dict(vocab_start=0, vocab_size=case.vocab, temperature=kwargs["temperature"])
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        vocab_parallel_linear_loss(hidden, weight, targets, None, **kw)
    with pytest.raises(ValueError, match="segments must start at 0"):
        vocab_parallel_linear_loss(hidden, weight, targets, lambda *a: None, segments=[1, 15], **kw)


@pytest.fixture(scope="module")
def two_rank_checks(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    from distributed_utils import launch  # imports transformers: only where a launch is needed

    tmp = tmp_path_factory.mktemp("vocab_parallel_loss")
    launch(2, HERE, str(tmp), timeout=120)
    passed = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    assert passed[0] == passed[1], passed
    return passed[0]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_equal_one_device(two_rank_checks):
    assert two_rank_checks == [c.name for c in LAUNCH_CASES]


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels on CPU tensors
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    passed = []
    for case in LAUNCH_CASES:
        with small_tiles(case), gpu_path_tiles(case):
            check_loss_case(case, rank, world, dist.group.WORLD)
        passed.append(case.name)
    dist.barrier()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])


def test_kept_tiles_are_not_recomputed(monkeypatch):
    """Where every tile fits the budget, the gradient pass recomputes no logits tile (the point
    of the fused loss); with the budget of ``small_tiles`` and the whole 300-row vocabulary in
    one shard (5 tiles of 64 columns), each 5-row sequence runs as 3 chunks of 2 rows: 6 of its 15
    tiles kept, 9 recomputed, 27 in all. The gradient pass is the only user of
    ``linear_logprob._logits_tile`` here (the shard's forward runs ``vocab_parallel._logits``)."""
    calls = []
    real = linear_logprob._logits_tile
    monkeypatch.setattr(linear_logprob, "_logits_tile", lambda *a: calls.append(1) or real(*a))
    for case, recomputed in ((LOSS_CASES[0], 0), (LOSS_CASES[4], 27)):
        calls.clear()
        hidden, weight, targets, kwargs = make_inputs(case, 2)
        with small_tiles(case):
            run(
                vocab_parallel_linear_loss, case, hidden, weight, kwargs.get("bias"), targets,
                kwargs, vocab_start=0, vocab_size=case.vocab,
            )  # fmt: skip
        assert len(calls) == recomputed, (case.name, len(calls))
