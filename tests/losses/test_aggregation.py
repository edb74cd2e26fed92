"""Loss aggregation and metric reduction: reference loops, error paths, and 2 real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from microrl.losses import (
    AggMode,
    LossDenominators,
    Metric,
    Reduce,
    aggregate,
    global_denominators,
    masked_partial_mean,
    reduce_metrics,
)


def ref_aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, seq_len_norm=None):
    rows = [[t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
    n_tokens = max(sum(map(len, rows)), 1)
    n_seqs = max(sum(1 for r in rows if r), 1)
    total = 0.0
    for b, ts in enumerate(rows):
        s = sum(float(values[b, t]) for t in ts)
        if mode == "token-mean":
            total += s / n_tokens
        elif mode == "seq-mean-token-sum":
            total += s / n_seqs
        elif mode == "seq-mean-token-mean":
            total += (s / len(ts) if ts else 0.0) / n_seqs
        else:
            total += s / (n_seqs * seq_len_norm)
    return total


@pytest.mark.parametrize("mode", [m.value for m in AggMode])
def test_aggregate_matches_reference_with_garbage_at_masked_positions(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 9, generator=g) > 0.5
    mask[2] = False  # an all-masked row
    mask[3] = False
    mask[3, 8] = True  # a length-1 row
    values = values.masked_fill(~mask, float("nan"))
    values.requires_grad_(True)
    d = global_denominators(mask, seq_len_norm=12.0)
    out = aggregate(values, mask.float(), mode, d)  # float masks are accepted
    out.backward()
    assert out.item() == pytest.approx(ref_aggregate(values.detach(), mask, mode, 12.0), rel=1e-12)
    assert torch.isfinite(values.grad).all() and (values.grad[~mask] == 0).all()


def test_global_denominators_counts_and_floor():
    mask = torch.tensor([[0, 1, 1], [0, 0, 0], [1, 0, 0]])
    d = global_denominators(mask)
    assert (d.n_tokens.item(), d.n_seqs.item(), d.grad_scale) == (3.0, 2.0, 1.0)
    empty = global_denominators(torch.zeros(2, 3))
    assert (empty.n_tokens.item(), empty.n_seqs.item()) == (1.0, 1.0)  # loss 0, not NaN
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), "token-mean", empty).item() == 0.0


def test_aggregation_errors():
    mask = torch.ones(2, 3)
    d = global_denominators(mask)
    with pytest.raises(TypeError, match="denominators"):
        aggregate(torch.ones(2, 3), mask, "token-mean", None)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(torch.ones(2, 3), mask, "mean", d)
    with pytest.raises(ValueError, match="seq_len_norm"):
        aggregate(torch.ones(2, 3), mask, "seq-mean-token-sum-norm", d)
    with pytest.raises(ValueError, match="seq_len_norm"):
        global_denominators(mask, seq_len_norm=0.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        aggregate(torch.ones(2, 3), torch.ones(3, 2), "token-mean", d)


def test_reduce_metrics_sums_partials_and_keeps_extremes():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    d = global_denominators(mask)
    values = torch.tensor([[1.0, 2.0, 99.0], [99.0, 3.0, 6.0]])
    parts = [
        {
            "mean": Metric(masked_partial_mean(values[i : i + 1], mask[i : i + 1], d)),
            "max": Metric(torch.where(mask[i], values[i], -math.inf).max(), Reduce.MAX),
        }
        for i in range(2)
    ]
    parts.append({"mean": Metric(torch.tensor(0.0)), "max": Metric.empty(Reduce.MAX)})
    out = reduce_metrics(parts)
    assert out == {"mean": pytest.approx(3.0), "max": 6.0}
    # No value anywhere: NaN ("no value"), not 0, which would read as a real extreme.
    empty = reduce_metrics([{"m": Metric.empty(Reduce.MIN)}, {"m": Metric.empty(Reduce.MIN)}])
    assert empty.keys() == {"m"} and math.isnan(empty["m"])
    assert math.isnan(reduce_metrics([{"m": Metric.empty(Reduce.MAX)}])["m"])
    # A real infinite extreme is a value, kept as is.
    assert reduce_metrics([{"m": Metric(torch.tensor(math.inf), Reduce.MAX)}]) == {"m": math.inf}
    with pytest.raises(ValueError, match="different reductions"):
        reduce_metrics([{"m": Metric(torch.tensor(1.0))}, {"m": Metric.empty(Reduce.MIN)}])


def _rank_main(rank: int, world: int, store_file: str, results) -> None:
    # A file rendezvous: no TCP port to pick, so no race with other runs on the machine.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        mask = torch.tensor([[1, 1, 0], [0, 0, 0]]) if rank == 0 else torch.tensor([[1, 1, 1]])
        d = global_denominators(mask)
        values = torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]) if rank == 0 else torch.ones(1, 3)
        metrics = {
            "mean": Metric(masked_partial_mean(values, mask, d)),
            "min": Metric(torch.where(mask.bool(), values, math.inf).min(), Reduce.MIN),
        }
        results[rank] = (
            d.n_tokens.item(),
            d.n_seqs.item(),
            d.grad_scale,
            reduce_metrics([metrics]),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_denominators_and_metrics_reduce_over_two_gloo_ranks(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        store = str(tmp_path / "rendezvous")
        mp.spawn(_rank_main, args=(2, store, results), nprocs=2, join=True)
        results = dict(results)
    for rank in range(2):
        n_tokens, n_seqs, scale, metrics = results[rank]
        assert (n_tokens, n_seqs, scale) == (5.0, 2.0, 2.0)
        assert metrics["mean"] == pytest.approx((1 + 2 + 3) / 5)
        assert metrics["min"] == 1.0


def test_loss_denominators_is_frozen():
    d = LossDenominators(torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(AttributeError):
        d.grad_scale = 2.0  # type: ignore[misc]
