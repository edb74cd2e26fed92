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
