"""``step_metrics``: the metrics both recipes log for a step, from the rollout's counts."""

from __future__ import annotations

import math
import time

import pytest
import torch
from tensordict import TensorDict

from microrl.run import Dist, step_metrics


def _batch() -> TensorDict:
    """2 rows: 3 and 1 response tokens (the second cut at max_new_tokens), 5 and 3 tokens."""
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    truncated = torch.tensor([False, True])
    return TensorDict(
        {"loss_mask": loss_mask, "attention_mask": attention_mask, "truncated": truncated},
        batch_size=[2],
    )


UPDATES = [
    {"loss": 1.0, "pg_clipfrac": 0.25, "mismatch/kl_k3": 0.5},
    {"loss": 3.0, "pg_clipfrac": 0.75, "mismatch/kl_k3": 1.5},
]


def test_rates_means_entropy_and_the_overlong_penalty() -> None:
    batch, scores, penalty = _batch(), torch.tensor([1.0, 0.0]), torch.tensor([0.0, -0.5])
    entropy = torch.tensor([[9.0, 9.0, 1.0, 2.0, 3.0], [9.0, 9.0, 6.0, 9.0, 9.0]])
    old = TensorDict({"entropy": entropy}, batch_size=[2])
    critic = [{"loss": 0.5}, {"loss": 1.5}]
    t0 = time.perf_counter()
    metrics = step_metrics(
        batch, scores, penalty, old, UPDATES, Dist(), t0, critic_updates=critic, overlong=True
    )
    assert metrics["reward"] == 0.5 and metrics["reward/overlong_penalty"] == -0.25
    assert metrics["loss"] == 2.0 and metrics["clipfrac"] == 0.5  # the engine's pg_clipfrac
    assert metrics["mismatch/kl_k3"] == 1.0 and metrics["critic/loss"] == 1.0
    assert metrics["response_tokens"] == 2.0 and metrics["truncated_frac"] == 0.5
    assert metrics["entropy"] == pytest.approx(12.0 / 4)  # over the response tokens only
    assert 0 < metrics["step_time"] <= time.perf_counter() - t0
    assert metrics["tokens_per_s"] == pytest.approx(8 / metrics["step_time"])
    assert list(metrics)[:2] == ["reward", "loss"]  # the order metrics.jsonl keeps


def test_the_bypass_reports_the_first_updates_mismatch_and_no_entropy() -> None:
    """Without the old pass only the first update ran at the weights that sampled."""
    batch, scores = _batch(), torch.tensor([0.0, 0.0])
    metrics = step_metrics(batch, scores, torch.zeros(2), None, UPDATES, Dist(), 0.0)
    assert metrics["mismatch/kl_k3"] == 0.5 and "entropy" not in metrics
    assert "reward/overlong_penalty" not in metrics and not any(
        k.startswith("critic/") for k in metrics
    )
    assert math.isfinite(metrics["tokens_per_s"])


def test_image_rows_report_their_own_mismatch() -> None:
    """``mismatch/image/*``: the ``mismatch/*`` figures over the rows with images only (the
    losses' own definitions on those rows' tokens); none for a text rollout."""
    from microrl.engine.vision import pad_images
    from microrl.losses import LossDenominators, mismatch_metrics

    gen = torch.Generator().manual_seed(0)
    batch = _batch()
    batch = torch.cat([batch, batch])  # 4 rows: 0 and 3 with images
    grid = torch.tensor([[1, 2, 2]])
    batch.update(
        pad_images(
            [
                (torch.randn(4, 3, generator=gen), grid),
                None,
                None,
                (torch.randn(4, 3, generator=gen), grid),
            ]
        )
    )
    batch["rollout_logprobs"] = -torch.rand(4, 5, generator=gen)
    logprobs = batch["rollout_logprobs"] + 0.3 * torch.randn(4, 5, generator=gen)
    old = TensorDict({"entropy": torch.ones(4, 5), "logprobs": logprobs}, batch_size=[4])
    metrics = step_metrics(batch, torch.zeros(4), torch.zeros(4), old, UPDATES, Dist(), 0.0)
    mask = batch["loss_mask"].clone()
    mask[1:3] = False
    n = mask.sum().float()
    expected = mismatch_metrics(
        logprobs, batch["rollout_logprobs"], mask, LossDenominators(n, torch.tensor(2.0))
    )
    for name, metric in expected.items():
        got = metrics[name.replace("mismatch/", "mismatch/image/")]
        assert got == pytest.approx(metric.value.item(), rel=1e-6), name
    assert metrics["mismatch/kl_k3"] == 1.0  # the whole batch's: the engine's, unchanged
    text = step_metrics(
        batch.exclude("pixel_values", "image_grid_thw"),
        torch.zeros(4),
        torch.zeros(4),
        old,
        UPDATES,
        Dist(),
        0.0,
    )
    assert not any(k.startswith("mismatch/image/") for k in text)


class _TwoRanks(Dist):
    """Rank ``rank`` of 2, whose ``sum`` adds the other rank's values (given) to its own."""

    def sum(self, values):
        return [a + b for a, b in zip(values, self.other, strict=True)]


def test_image_mismatch_over_two_ranks_is_the_one_process_figure() -> None:
    """Each rank's image rows: the means over both ranks' image tokens, the max of both."""
    from microrl.engine.vision import pad_images

    gen = torch.Generator().manual_seed(1)
    grid = torch.tensor([[1, 2, 2]])

    def half(with_images: list[bool]):
        batch = _batch()
        rows = [(torch.randn(4, 3, generator=gen), grid) if w else None for w in with_images]
        if any(with_images):
            batch.update(pad_images(rows))
        batch["rollout_logprobs"] = -torch.rand(2, 5, generator=gen)
        noisy = batch["rollout_logprobs"] + 0.3 * torch.randn(2, 5, generator=gen)
        return batch, TensorDict({"entropy": torch.ones(2, 5), "logprobs": noisy}, batch_size=[2])

    (b0, o0), (b1, o1) = half([True, False]), half([True, True])
    zeros = torch.zeros(2)

    def on_rank(rank, batch, old, other):
        dist_info = _TwoRanks(rank=rank, world_size=2)
        object.__setattr__(dist_info, "other", other)
        return step_metrics(batch, zeros, zeros, old, UPDATES, dist_info, 0.0)

    # the values each rank contributes, read off a pass that adds nothing
    seen = {}

    class Recorder(Dist):
        def sum(self, values):
            seen[self.rank] = list(values)
            return list(values)

    for rank, (batch, old) in enumerate([(b0, o0), (b1, o1)]):
        step_metrics(batch, zeros, zeros, old, UPDATES, Recorder(rank=rank, world_size=2), 0.0)
    first = on_rank(0, b0, o0, seen[1])
    second = on_rank(1, b1, o1, seen[0])
    whole = step_metrics(
        torch.cat([b0, b1]),
        torch.zeros(4),
        torch.zeros(4),
        torch.cat([o0, o1]),
        UPDATES,
        Dist(),
        0.0,
    )
    names = [k for k in whole if k.startswith("mismatch/image/")]
    assert len(names) == 4 and whole["mismatch/image/abs_diff_max"] > 0
    for name in names:
        assert first[name] == second[name] == pytest.approx(whole[name], rel=1e-9), name


def test_frac_zero_std_counts_every_ranks_equal_reward_groups() -> None:
    """``frac_reward_zero_std``: groups whose rewards trained on (score + overlong penalty) are
    all equal, over every rank's groups: (1 + 0) / (1 + 3), not the mean of the ranks'
    fractions (1/1 and 0/3)."""
    batch = torch.cat([_batch()] * 3)  # 6 rows
    zeros = torch.zeros(6)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    penalty = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -0.5])  # group 2's spread: the penalty's
    one = step_metrics(batch, scores, penalty, None, UPDATES, Dist(), 0.0, groups=groups)
    assert one["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert step_metrics(batch, scores, zeros, None, UPDATES, Dist(), 0.0, groups=groups)[
        "frac_reward_zero_std"
    ] == pytest.approx(2 / 3)
    assert "frac_reward_zero_std" not in step_metrics(
        batch, scores, penalty, None, UPDATES, Dist(), 0.0
    )
    # Two ranks: rank 0 one group (equal rewards), rank 1 three groups (all spread).
    halves = [
        (batch[:2], torch.tensor([1.0, 1.0]), torch.tensor([0, 0])),
        (batch, torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5]), groups),
    ]
    seen = {}

    class Recorder(Dist):
        def sum(self, values):
            seen[self.rank] = list(values)
            return list(values)

    for rank, (b, s, g) in enumerate(halves):
        zero = torch.zeros(len(s))
        step_metrics(b, s, zero, None, UPDATES, Recorder(rank=rank, world_size=2), 0.0, groups=g)
    for rank, (b, s, g) in enumerate(halves):
        dist_info = _TwoRanks(rank=rank, world_size=2)
        object.__setattr__(dist_info, "other", seen[1 - rank])
        zero = torch.zeros(len(s))
        metrics = step_metrics(b, s, zero, None, UPDATES, dist_info, 0.0, groups=g)
        assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 4)
