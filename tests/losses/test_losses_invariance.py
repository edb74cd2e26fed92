"""The normalisation contract (docs/losses.md): any micro-batch split, any number of
simulated data-parallel ranks, same loss, same gradient, same metrics, for every aggregation mode.

The mini-batch mixes very different lengths, a length-1 response and an all-masked row, with
left, right and two-sided padding, and NaN at every masked position.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from microrl.losses import (
    AggMode,
    PolicyLossConfig,
    global_denominators,
    policy_loss,
    reduce_metrics,
    sft_loss,
    value_loss,
)

SEQ_LEN_NORM = 24.0
B, T = 7, 24
SPANS = [(23, 24), (1, 24), (0, 0), (10, 15), (0, 17), (3, 5), (6, 17)]  # [start, stop) per row
# micro-batch splits of the rows (lists of row-index lists); not necessarily contiguous, since
# token-budget micro-batching and packing reorder rows
SPLITS = {
    "1": [list(range(B))],
    "2": [[0, 1, 2, 3], [4, 5, 6]],
    "3-permuted": [[5, 0], [3, 6, 2], [1, 4]],
    "B": [[i] for i in range(B)],
    "1+6": [[2], [0, 1, 3, 4, 5, 6]],
}
# simulated data-parallel ranks: each holds a share of the rows, split again into micro-batches
DP_SHARDS = {
    "dp2": [[[0, 2], [4, 6]], [[1, 3, 5]]],
    "dp3": [[[6]], [[0, 1], [2]], [[3], [4], [5]]],
}


def make_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (start, stop) in enumerate(SPANS):
        mask[b, start:stop] = True

    def rand(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(B, T, generator=g, dtype=torch.float64) * scale

    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + rand(0.3)
    data = {
        "logprobs": lp,
        "old_logprobs": old,
        "advantages": rand(),
        "ref_logprobs": lp + rand(0.3),
        "entropy": torch.rand(B, T, generator=g, dtype=torch.float64),
        "rollout_logprobs": old + rand(0.2),
        "old_values": rand(),
        "returns": rand(),
    }
    out = {k: v.masked_fill(~mask, float("nan")) for k, v in data.items()}
    out["loss_mask"] = mask
    return out


LOSSES = {
    "ppo-kl-entropy-tis": PolicyLossConfig(
        name="ppo", clip_ratio_high=0.28, kl_coef=0.1, entropy_coef=0.01, tis_cap=1.5
    ),
    "gspo": PolicyLossConfig(name="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05),
    "cispo-k1+": PolicyLossConfig(name="cispo", kl_coef=0.05, kl_estimator="k1+"),
    "reinforce": PolicyLossConfig(name="reinforce"),
    "value": "value",
    "sft": "sft",
}


def call(kind, batch, rows, leaves, denominators, mode):
    """One micro-batch: the rows ``rows`` of the batch, gradients flowing into ``leaves``."""
    idx = torch.tensor(rows)
    sl = {k: v[idx] for k, v in batch.items()}
    lp, ent = leaves["logprobs"][idx], leaves["entropy"][idx]
    if kind == "value":
        return value_loss(
            lp,
            sl["old_values"],
            sl["returns"],
            sl["loss_mask"],
            denominators,
            mode,
            cliprange_value=0.3,
        )
    if kind == "sft":
        return sft_loss(lp, sl["loss_mask"], denominators, mode)
    return policy_loss(
        lp,
        sl["old_logprobs"],
        sl["advantages"],
        sl["loss_mask"],
        denominators,
        kind,
        mode,
        ref_logprobs=sl["ref_logprobs"],
        entropy=ent,
        rollout_logprobs=sl["rollout_logprobs"],
    )


def run(kind, batch, ranks, mode):
    """Sum of partial losses per rank, then what the gradient all-reduce (average) produces."""
    world = len(ranks)
    denominators = global_denominators(batch["loss_mask"], seq_len_norm=SEQ_LEN_NORM)
    denominators = dataclasses.replace(denominators, grad_scale=float(world))
    grads = {k: torch.zeros(B, T, dtype=torch.float64) for k in ("logprobs", "entropy")}
    loss_sum, all_metrics = 0.0, []
    for micro_batches in ranks:
        leaves = {
            k: batch[k].detach().clone().requires_grad_(True) for k in ("logprobs", "entropy")
        }
        rank_loss = 0.0
        for rows in micro_batches:
            loss, metrics = call(kind, batch, rows, leaves, denominators, mode)
            loss.backward(torch.tensor(0.5, dtype=loss.dtype))  # upstream gradient != 1
            rank_loss += loss.item()
            all_metrics.append(metrics)
        loss_sum += rank_loss
        for k in grads:
            if leaves[k].grad is not None:
                grads[k] += leaves[k].grad / world  # the DP all-reduce averages
    return loss_sum / world, grads, reduce_metrics(all_metrics)


@pytest.mark.parametrize("mode", [m.value for m in AggMode])
@pytest.mark.parametrize("kind", list(LOSSES))
def test_micro_batch_and_dp_splits_change_nothing(kind, mode):
    batch = make_batch(seed=list(LOSSES).index(kind))
    loss_fn = LOSSES[kind]
    full_loss, full_grads, full_metrics = run(loss_fn, batch, [SPLITS["1"]], mode)
    assert full_grads["logprobs"].abs().sum() > 0
    mask = batch["loss_mask"]
    for name, ranks in [*((k, [v]) for k, v in SPLITS.items()), *DP_SHARDS.items()]:
        loss, grads, metrics = run(loss_fn, batch, ranks, mode)
        assert loss == pytest.approx(full_loss, rel=1e-12, abs=1e-14), name
        for k, g in grads.items():
            assert torch.isfinite(g).all() and (g[~mask] == 0).all(), (name, k)
            torch.testing.assert_close(g, full_grads[k], rtol=1e-12, atol=1e-14, msg=f"{name} {k}")
        assert metrics.keys() == full_metrics.keys()
        for key, value in full_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


def test_loss_metric_equals_reported_loss_and_sums_over_ranks():
    """pg_loss/vf_loss/sft_loss metrics are the aggregated terms without grad_scale: summed over
    micro-batches and ranks they equal the single-process loss (here with no KL / entropy)."""
    batch = make_batch(seed=11)
    cfg = PolicyLossConfig()
    for mode in AggMode:
        full_loss, _, full_metrics = run(cfg, batch, [SPLITS["1"]], mode)
        assert full_metrics["pg_loss"] == pytest.approx(full_loss, rel=1e-6)
        _, _, dp_metrics = run(cfg, batch, DP_SHARDS["dp3"], mode)
        assert dp_metrics["pg_loss"] == pytest.approx(full_loss, rel=1e-6)
