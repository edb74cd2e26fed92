"""Advantage estimators against per-sample Python references (float64 Python floats)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from tensordict import TensorDict

from microrl.losses import (
    WHITEN_EPS,
    broadcast_to_tokens,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    scores_to_token_rewards,
    whiten,
)

# --------------------------------------------------------------------------- references


def ref_whiten(values: list[float], shift_mean: bool = True) -> list[float]:
    mean = statistics.fmean(values)
    var = statistics.variance(values) if len(values) > 1 else 0.0
    out = [(v - mean) / math.sqrt(var + WHITEN_EPS) for v in values]
    return out if shift_mean else [o + mean for o in out]


def ref_groups(scores: list[float], ids: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return groups


def ref_grpo(scores, ids, scale_by_std=True, eps=1e-6):
    out = [0.0] * len(scores)
    for rows in ref_groups(scores, ids).values():
        vals = [scores[i] for i in rows]
        if len(rows) == 1 or max(vals) == min(vals):
            continue  # no signal: exactly 0
        mean = statistics.fmean(vals)
        std = statistics.stdev(vals)
        for i in rows:
            out[i] = (scores[i] - mean) / max(std, eps) if scale_by_std else scores[i] - mean
    return out


def ref_rloo(scores, ids):
    out = [0.0] * len(scores)
    for rows in ref_groups(scores, ids).values():
        vals = [scores[i] for i in rows]
        if len(rows) == 1 or max(vals) == min(vals):
            continue
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            out[i] = scores[i] - sum(others) / len(others)
    return out


def ref_gae(rewards, values, mask, gamma, lam):
    """Row by row over the loss tokens only (masked positions skipped)."""
    batch, length = len(rewards), len(rewards[0])
    adv = [[0.0] * length for _ in range(batch)]
    ret = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        steps = [t for t in range(length) if mask[b][t]]
        next_value, running = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
            ret[b][t] = running + values[b][t]
            next_value = values[b][t]
    return adv, ret


def assert_list_close(actual: torch.Tensor, expected, rtol=1e-6, atol=1e-6, what=""):
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol, msg=what)


# --------------------------------------------------------------------------- group estimators

# non-dyadic zero-variance groups, a 7-vs-1 split, a singleton, a mixed group; ids non-contiguous
# and rows of one group not adjacent
GROUP_SCORES = [0.1, 0.35, 0.1, 1 / 3, 0.35, 0.1, 1 / 3, 0.35, 0.1, 1 / 3, 0.35]
GROUP_IDS = [70, 5, 70, -3, 5, 70, -3, 5, 70, -3, 5]
SEVEN_ONE = [1.0] * 7 + [0.0]
MIXED = [0.2, 0.9, 0.5, 0.5]


def group_batch(dtype=torch.float32):
    scores = GROUP_SCORES + SEVEN_ONE + [0.42] + MIXED
    ids = GROUP_IDS + [11] * 8 + [999] + [12] * 4
    return torch.tensor(scores, dtype=dtype), torch.tensor(ids), scores, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_match_reference(estimator, dtype):
    scores, ids, _, id_list = group_batch(dtype)
    # the reference sees the very values the estimator sees (float32-rounded when float32)
    score_list = scores.double().tolist()
    if estimator == "rloo":
        adv, info = rloo_advantages(scores, ids)
        expected = ref_rloo(score_list, id_list)
    else:
        scale = estimator == "grpo"
        adv, info = grpo_advantages(scores, ids, scale_by_std=scale)
        expected = ref_grpo(score_list, id_list, scale_by_std=scale)
    assert adv.dtype == dtype and adv.shape == scores.shape
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert_list_close(adv, expected, rtol=tol, atol=tol, what=estimator)
    # zero-variance groups (0.1, 0.35, 1/3) and the singleton: exactly 0, not float residue
    assert (adv[: len(GROUP_SCORES)] == 0).all(), adv[: len(GROUP_SCORES)]
    assert adv[len(GROUP_SCORES) + 8] == 0  # the singleton
    assert info.num_groups == 6
    assert info.num_singleton_groups == 1
    assert info.num_zero_variance_groups == 3
    assert info.informative.tolist() == [False] * 11 + [True] * 8 + [False] + [True] * 4
    metrics = info.metrics()
    assert metrics["groups/singleton"] == 1.0 and metrics["groups/zero_variance"] == 3.0


def test_seven_vs_one_split_exact_values():
    adv, _ = grpo_advantages(torch.tensor(SEVEN_ONE), torch.zeros(8, dtype=torch.long))
    std = math.sqrt((7 * (1 / 8) ** 2 + (7 / 8) ** 2) / 7)  # unbiased, = sqrt(1/8)
    assert adv[:7].tolist() == pytest.approx([(1 / 8) / std] * 7, rel=1e-6)
    assert adv[7].item() == pytest.approx(-(7 / 8) / std, rel=1e-6)
    rloo, _ = rloo_advantages(torch.tensor(SEVEN_ONE), torch.zeros(8, dtype=torch.long))
    assert rloo[:7].tolist() == pytest.approx([1 - 6 / 7] * 7) and rloo[7].item() == -1.0


def test_large_zero_variance_group_stays_exactly_zero():
    """float32 0.35 * 4096: a float32 mean carries residue that std scaling would blow up."""
    scores = torch.full((4096,), 0.35)
    naive = (scores - scores.mean()) / (scores.std() + 1e-6)  # what we must not do
    adv, info = grpo_advantages(scores, torch.zeros(4096, dtype=torch.long))
    assert (adv == 0).all() and info.num_zero_variance_groups == 1
    assert naive.abs().max() > 1e-3  # the hazard is real: float32 residue survives naively


def test_integer_and_bool_scores_and_no_grad():
    ids = torch.tensor([0, 0, 1, 1])
    adv, _ = grpo_advantages(torch.tensor([1, 0, 1, 1]), ids)
    assert adv.dtype == torch.float32 and adv[2:].tolist() == [0.0, 0.0]
    adv_b, _ = rloo_advantages(torch.tensor([True, False, True, True]), ids)
    assert adv_b.tolist() == [1.0, -1.0, 0.0, 0.0]
    scores = torch.tensor([0.2, 0.8, 0.1, 0.3], requires_grad=True)
    adv, _ = grpo_advantages(scores, ids)
    assert not adv.requires_grad


def test_filtering_keeps_every_per_row_tensor_aligned():
    scores, ids, _, _ = group_batch()
    batch_size = scores.shape[0]
    tokens = torch.arange(batch_size)[:, None] * 100 + torch.arange(6)  # row b holds 100*b + t
    adv, info = grpo_advantages(scores, ids)
    td = TensorDict(
        {"scores": scores, "group_ids": ids, "advantages": adv, "input_ids": tokens},
        batch_size=[batch_size],
    )
    keep = info.keep_index()
    kept = td[keep]
    assert keep.tolist() == sorted(keep.tolist())  # original order
    assert kept.batch_size[0] == int(info.informative.sum()) == 12
    for row, original in enumerate(keep.tolist()):
        assert (kept["input_ids"][row] // 100 == original).all()
        assert kept["scores"][row] == scores[original] and kept["group_ids"][row] == ids[original]
    assert (kept["advantages"] != 0).all()  # only rows with signal remain


def test_group_bad_inputs():
    scores = torch.tensor([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(scores, torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(scores, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="scores"):
        rloo_advantages(scores[None], torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match="scores"):
        grpo_advantages(torch.tensor([0.1, float("nan"), 0.3]), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(scores, torch.tensor([0, 0, 1]), eps=0.0)


# --------------------------------------------------------------------------- GAE


def gae_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, length = 4, 12
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, 3:12] = True
    mask[0, 6:8] = False  # tool output inside the response: skipped by the recursion
    mask[1, 0:1] = True  # a length-1 response
    mask[2, 2:10] = True
    mask[2, [4, 5, 8]] = False
    # row 3: all masked
    rewards = torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.1
    rewards[0, 11] = 1.0
    rewards[2, 9] = -1.0
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    # garbage at masked positions must be ignored
    rewards = rewards.masked_fill(~mask, float("nan"))
    values = values.masked_fill(~mask, float("inf"))
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gae_matches_reference(gamma, lam, dtype):
    rewards, values, mask = gae_batch()
    rewards, values = rewards.to(dtype), values.to(dtype)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref_gae(
        rewards.double().tolist(), values.double().tolist(), mask.tolist(), gamma, lam
    )
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert adv.dtype == dtype and ret.dtype == dtype
    assert_list_close(adv, ref_adv, tol, tol, "advantages")
    assert_list_close(ret, ref_ret, tol, tol, "returns")
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # returns = advantages + values on the loss tokens
    torch.testing.assert_close(ret[mask], adv[mask] + values[mask])


def test_gae_skips_tool_tokens_instead_of_ending_the_episode():
    """A masked gap inside a response must behave like the gap were not there."""
    rewards, values, mask = gae_batch()
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9)
    keep = mask[0]
    compact_adv, _ = gae_advantages(
        rewards[0][keep][None],
        values[0][keep][None],
        torch.ones(1, int(keep.sum()), dtype=torch.bool),
        gamma=0.97,
        lam=0.9,
    )
    torch.testing.assert_close(adv[0][keep], compact_adv[0])


def test_gae_monte_carlo_special_case_and_bad_inputs():
    rewards, values, mask = gae_batch()
    adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    r = torch.where(mask, rewards, 0.0)
    # lambda = gamma = 1: advantage = reward-to-go - V
    to_go = r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(adv[mask], (to_go - torch.where(mask, values, 0.0))[mask])
    with pytest.raises(ValueError, match="gamma"):
        gae_advantages(rewards, values, mask, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="lam"):
        gae_advantages(rewards, values, mask, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="values"):
        gae_advantages(rewards, values[:, 1:], mask, gamma=1.0, lam=1.0)
    bad = rewards.clone()
    bad[0, 3] = float("nan")
    with pytest.raises(ValueError, match="rewards"):
        gae_advantages(bad, values, mask, gamma=1.0, lam=1.0)


# --------------------------------------------------------------------------- REINFORCE++, whiten


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(gamma):
    rewards, _, mask = gae_batch(seed=3)
    adv, info = reinforce_pp_advantages(rewards, mask, gamma=gamma)
    assert info is None
    rows = rewards.tolist()
    returns = {}
    for b in range(mask.shape[0]):
        running = 0.0
        for t in reversed([t for t in range(mask.shape[1]) if mask[b, t]]):
            running = rows[b][t] + gamma * running
            returns[(b, t)] = running
    keys = sorted(returns)
    white = ref_whiten([returns[k] for k in keys])
    expected = torch.zeros(mask.shape, dtype=torch.float64)
    for k, v in zip(keys, white, strict=True):
        expected[k] = v
    torch.testing.assert_close(adv, expected, rtol=1e-10, atol=1e-12)
    raw, _ = reinforce_pp_advantages(rewards, mask, gamma=gamma, whiten_advantages=False)
    assert raw[mask].tolist() == pytest.approx([returns[tuple(k)] for k in mask.nonzero().tolist()])


def test_reinforce_pp_with_group_baseline():
    batch, length = 6, 5
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 3:] = False
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    final = torch.tensor([1.0, 0.0, 0.5, 0.35, 0.35, 0.7])
    rewards = scores_to_token_rewards(final, mask)
    raw, info = reinforce_pp_advantages(rewards, mask, group_ids=ids, whiten_advantages=False)
    per_row = [1.0 - 0.5, 0.0 - 0.5, 0.0, 0.0, 0.0, 0.0]  # group 1 has zero variance, 2 is single
    for b in range(batch):
        assert raw[b][mask[b]].tolist() == pytest.approx([per_row[b]] * int(mask[b].sum()))
    assert info.num_singleton_groups == 1 and info.num_zero_variance_groups == 1
    adv, _ = reinforce_pp_advantages(rewards, mask, group_ids=ids)
    torch.testing.assert_close(adv, whiten(raw, mask))
    with pytest.raises(ValueError, match="gamma"):
        reinforce_pp_advantages(rewards, mask, group_ids=ids, gamma=0.9)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_reference(shift_mean):
    g = torch.Generator().manual_seed(4)
    values = torch.randn(3, 7, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(3, 7, generator=g) > 0.4
    values = values.masked_fill(~mask, float("nan"))
    out = whiten(values, mask, shift_mean=shift_mean)
    expected = ref_whiten(values[mask].tolist(), shift_mean)
    assert out[mask].tolist() == pytest.approx(expected, rel=1e-12)
    assert (out[~mask] == 0).all()


def test_broadcast_and_token_rewards():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    per_seq = torch.tensor([0.5, 2.0, -1.0])
    tokens = broadcast_to_tokens(per_seq, mask)
    assert tokens.tolist() == [[0, 0.5, 0.5, 0], [0, 0, 0, 0], [-1, -1, -1, -1]]
    kl = torch.full((3, 4), 0.1)
    rewards = scores_to_token_rewards(per_seq, mask, kl=kl, kl_coef=0.5)
    expected = [[0, -0.05, 0.45, 0], [0, 0, 0, 0], [-0.05, -0.05, -0.05, -1.05]]
    assert rewards.tolist() == [pytest.approx(r) for r in expected]
    with pytest.raises(ValueError, match="per_sequence"):
        broadcast_to_tokens(per_seq[:2], mask)
    with pytest.raises(ValueError, match="kl"):
        scores_to_token_rewards(per_seq, mask, kl_coef=0.1)
