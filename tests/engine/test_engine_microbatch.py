"""Micro-batch planning, compaction and packing: pure functions against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from engine_utils import make_batch
from tensordict import TensorDict

from microrl.engine.microbatch import (
    compact_rows,
    micro_batch_cost,
    plan_micro_batches,
    scatter_rows,
    span_starts_and_lengths,
)
from microrl.engine.packing import pack, packed_index, unpack


def _check_partition(plan: list[list[int]], n: int) -> None:
    flat = sorted(itertools.chain.from_iterable(plan))
    assert flat == list(range(n)), "every row exactly once"


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("seed", range(6))
def test_token_budget_is_strict_and_balanced(packed: bool, seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(16, 256)
    plan = plan_micro_batches(lengths, max_tokens=budget, packed=packed)
    _check_partition(plan, len(lengths))
    costs = [micro_batch_cost([lengths[i] for i in g], packed=packed) for g in plan]
    for group, cost in zip(plan, costs, strict=True):
        assert cost <= budget or len(group) == 1, (group, cost, budget)
    if packed:  # never more micro-batches than first-fit decreasing needs
        assert len(plan) <= len(_first_fit_decreasing(lengths, budget))


def _first_fit_decreasing(lengths: list[int], budget: int) -> list[int]:
    bins: list[int] = []
    for n in sorted(lengths, reverse=True):
        for j, load in enumerate(bins):
            if load + n <= budget:
                bins[j] += n
                break
        else:
            bins.append(n)
    return bins


def test_padded_plan_is_optimal_for_consecutive_runs_on_small_cases() -> None:
    """Brute force over all splits of the sorted rows into consecutive runs."""
    rng = random.Random(0)
    for _ in range(40):
        lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 7))]
        budget = rng.randint(20, 60)
        plan = plan_micro_batches(lengths, max_tokens=budget, packed=False)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        best = None
        for cuts in itertools.product([0, 1], repeat=len(order) - 1):
            groups, cur = [], [order[0]]
            for cut, i in zip(cuts, order[1:], strict=True):
                if cut:
                    groups.append(cur)
                    cur = []
                cur.append(i)
            groups.append(cur)
            costs = [micro_batch_cost([lengths[i] for i in g], packed=False) for g in groups]
            if all(c <= budget or len(g) == 1 for c, g in zip(costs, groups, strict=True)):
                key = (len(groups), max(costs))
                best = key if best is None or key < best else best
        costs = [micro_batch_cost([lengths[i] for i in g], packed=False) for g in plan]
        assert (len(plan), max(costs)) == best, (lengths, budget, plan)


def test_fixed_size_groups_and_minimum_count() -> None:
    lengths = [5, 9, 2, 7, 7]
    plan = plan_micro_batches(lengths, micro_batch_size=2)
    assert plan == [[1, 3], [4, 0], [2]]  # longest first, ties in row order
    padded = plan_micro_batches(lengths, micro_batch_size=2, min_micro_batches=5)
    assert padded[:3] == plan and padded[3:] == [[], []]
    for packed in (False, True):
        spread = plan_micro_batches(lengths, max_tokens=1000, packed=packed, min_micro_batches=4)
        assert len(spread) == 4 and all(spread)
        _check_partition(spread, 5)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"micro_batch_size": 2, "max_tokens": 8}, {"micro_batch_size": 0}, {"max_tokens": 0}],
)
def test_bad_plan_arguments(kwargs) -> None:
    with pytest.raises(ValueError):
        plan_micro_batches([3, 4], **kwargs)


def test_compact_then_scatter_round_trips_any_padding() -> None:
    batch = make_batch(7, 11, padding="mixed", seed=5)
    batch["per_row"] = torch.arange(7.0)
    starts, lengths = span_starts_and_lengths(batch["attention_mask"])
    rows = [5, 0, 3]
    width = int(lengths[rows].max())
    micro = compact_rows(batch, rows, starts, lengths, width)
    assert micro.batch_size == torch.Size([3]) and micro["input_ids"].shape == (3, width)
    assert torch.equal(micro["per_row"], torch.tensor([5.0, 0.0, 3.0]))
    for j, row in enumerate(rows):
        n, s = int(lengths[row]), int(starts[row])
        assert micro["attention_mask"][j].tolist() == [True] * n + [False] * (width - n)
        assert torch.equal(micro["input_ids"][j, :n], batch["input_ids"][row, s : s + n])
        assert torch.equal(micro["position_ids"][j, :n], torch.arange(n))
        assert (micro["advantages"][j, n:] == 0).all()
    out = torch.zeros(7, 11)
    scatter_rows(micro["advantages"], rows, starts, lengths, out)
    expected = torch.where(batch["attention_mask"], batch["advantages"], 0.0)
    assert torch.equal(out[rows], expected[rows])
    assert (out[[1, 2, 4, 6]] == 0).all()


def test_pack_unpack_round_trip_with_gradient() -> None:
    valid = torch.tensor([[True, True, True, False], [True, False, False, False], [True] * 4])
    values = torch.randn(3, 4, 5, requires_grad=True)
    index = packed_index(valid, 8)
    assert index.tolist() == [0, 1, 2, 4, 8, 9, 10, 11]  # row-major: sequences stay contiguous
    packed = pack(values, index)
    assert packed.shape == (1, 8, 5) and torch.equal(packed[0], values[valid])
    restored = unpack(packed, index, valid)
    assert torch.equal(restored[valid], values[valid]) and (restored[~valid] == 0).all()
    restored.sum().backward()
    assert torch.equal(values.grad, valid.float().unsqueeze(-1).expand(3, 4, 5))
    with pytest.raises(ValueError, match="valid"):
        packed_index(valid[0], 3)


def test_span_lengths_of_a_tensordict_batch() -> None:
    td = TensorDict(
        attention_mask=torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1]]).bool(),
        batch_size=[3],
    )
    starts, lengths = span_starts_and_lengths(td["attention_mask"])
    assert starts.tolist() == [1, 0, 3] and lengths.tolist() == [2, 4, 1]
