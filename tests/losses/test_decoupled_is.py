"""AReaL's decoupled objective, ``policy_loss.decoupled_is_cap`` (losses/mismatch.py,
docs/losses.md#rollouttrainer-mismatch).

Fu et al. 2025 (arXiv 2505.24298): the PPO ratio is ``pi / pi_prox`` (``pi_prox``: the
``old_logprobs`` the trainer recomputes at its current weights), and each token's pg loss is
weighted by the detached behaviour weight ``w = pi_prox / pi_behav`` (``pi_behav``: the stale
sampler's ``rollout_logprobs``), 0 where ``w`` exceeds the cap. Checked against a float64
reference written here from that formula (loss, gradient, metrics) for several aggregation
modes, with NaN/inf at masked positions; exact under micro-batch splits in the engine; off by
default; bad values rejected naming the key.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_utils import assert_close_dicts, grads_of, make_batch, tiny_model
from loss_utils import leaf
from loss_utils import make_batch as loss_batch

from microrl.configs import ActorConfig
from microrl.engine import ActorEngine
from microrl.losses import PolicyLossConfig, global_denominators, policy_loss, reduce_metrics

B, T = 6, 11
CAP = 1.6
# A ratio band and clips restated here from docs/losses.md: the reference is the formula.
LOW, HIGH, DUAL = 0.8, 1.2, 3.0
LOG_R_CLAMP = 20.0


def _reference(lp, batch, *, cap, mode):
    """``agg(w * ppo_pg(lp, old, A))`` in float64, ``w = r * [r <= cap]``,
    ``r = exp(clamp(old - rollout))``; ``lp`` a clean leaf."""
    mask = batch["loss_mask"]
    m = mask.double()

    def clean(name):
        return torch.where(mask, batch[name].double(), 0.0)

    old, adv, rollout = clean("old_logprobs"), clean("advantages"), clean("rollout_logprobs")
    ratio = torch.exp((lp - old).clamp(-LOG_R_CLAMP, LOG_R_CLAMP))
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(LOW, HIGH))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * DUAL), pg)
    w = torch.exp((old - rollout).clamp(-LOG_R_CLAMP, LOG_R_CLAMP))
    over = mask & (w > cap)
    w = torch.where(over, 0.0, w) * m
    weighted = w * pg * m
    if mode == "token-mean":
        loss = weighted.sum() / m.sum()
    elif mode == "seq-mean-token-mean":
        rows = mask.any(1)
        per_row = weighted.sum(1) / m.sum(1).clamp_min(1)
        loss = per_row[rows].sum() / rows.sum()
    else:  # seq-mean-token-sum
        loss = weighted.sum(1)[mask.any(1)].sum() / mask.any(1).sum()
    n = m.sum()
    metrics = {
        "decoupled_is_weight_mean": float(w.sum() / n),
        "decoupled_is_capped_frac": float(over.double().sum() / n),
    }
    return loss, metrics


def _config(cap) -> PolicyLossConfig:
    return PolicyLossConfig(
        clip_ratio_low=1 - LOW, clip_ratio_high=HIGH - 1, clip_ratio_c=DUAL, decoupled_is_cap=cap
    )


def _batch(seed: int = 0) -> dict:
    """The loss tests' rows (NaN/inf off the mask), with behaviour weights spread well past the
    cap so that it binds on some tokens and not on others."""
    batch = loss_batch(torch.float64, seed, batch=B, length=T)
    mask = batch["loss_mask"]
    gen = torch.Generator().manual_seed(seed + 100)
    stale = 0.5 * torch.randn(B, T, dtype=torch.float64, generator=gen)
    batch["rollout_logprobs"] = torch.where(mask, batch["old_logprobs"] - stale, float("nan"))
    return batch


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("cap", [CAP, math.inf], ids=["cap", "uncapped"])
def test_decoupled_loss_and_gradient_match_the_formula(mode, cap) -> None:
    batch = _batch()
    mask = batch["loss_mask"]
    w = torch.exp(batch["old_logprobs"] - batch["rollout_logprobs"])[mask]
    assert (w > CAP).any() and (w < 1).any()  # the cap binds somewhere, and w is not all > 1
    lp = leaf(torch.where(mask, batch["logprobs"], 0.0))
    denominators = global_denominators(mask)
    loss, metrics = policy_loss(
        lp,
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        denominators,
        _config(cap),
        mode,
        rollout_logprobs=batch["rollout_logprobs"],
    )
    (grad,) = torch.autograd.grad(loss, lp)
    ref_lp = leaf(lp)
    ref_loss, ref_metrics = _reference(ref_lp, batch, cap=cap, mode=mode)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_lp)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    got = reduce_metrics([metrics])
    for name, value in ref_metrics.items():
        assert got[name] == pytest.approx(value, rel=1e-6), name
    if math.isinf(cap):
        assert got["decoupled_is_capped_frac"] == 0.0
    # The weight is detached: tokens the cap drops get exactly zero gradient.
    dropped = mask & (torch.exp(batch["old_logprobs"] - batch["rollout_logprobs"]) > cap)
    assert (grad[dropped] == 0).all()


def test_without_staleness_the_decoupled_loss_is_the_ppo_loss() -> None:
    """``rollout_logprobs == old_logprobs`` (a synchronous step): every weight is 1."""
    batch = _batch(seed=1)
    mask = batch["loss_mask"]
    lp = leaf(torch.where(mask, batch["logprobs"], 0.0))
    denominators = global_denominators(mask)
    args = (lp, batch["old_logprobs"], batch["advantages"], mask, denominators)
    plain, _ = policy_loss(*args, _config(None), "token-mean")
    decoupled, metrics = policy_loss(
        *args, _config(CAP), "token-mean", rollout_logprobs=batch["old_logprobs"]
    )
    torch.testing.assert_close(decoupled, plain, rtol=0, atol=0)
    assert reduce_metrics([metrics])["decoupled_is_weight_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(decoupled_is_cap=1.0), "policy_loss.decoupled_is_cap must be > 1"),
        (dict(decoupled_is_cap=-2.0), "policy_loss.decoupled_is_cap must be > 1"),
        (dict(decoupled_is_cap=True), "policy_loss.decoupled_is_cap must be > 1"),
        (dict(decoupled_is_cap=2.0, tis_cap=2.0), "decoupled_is_cap and policy_loss.tis_cap"),
        (dict(decoupled_is_cap=2.0, bypass_mode=True), "decoupled_is_cap"),
    ],
)
def test_bad_settings_name_the_key(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


def test_off_by_default_and_rollout_logprobs_required_when_on() -> None:
    assert PolicyLossConfig().decoupled_is_cap is None
    assert PolicyLossConfig(decoupled_is_cap=2.0).corrects_mismatch
    batch = _batch()
    mask = batch["loss_mask"]
    with pytest.raises(ValueError, match=r"rollout_logprobs is required.*decoupled_is_cap"):
        policy_loss(
            batch["logprobs"],
            batch["old_logprobs"],
            batch["advantages"],
            mask,
            global_denominators(mask),
            _config(2.0),
            "token-mean",
        )


@pytest.mark.usefixtures("intra_op_threads")
@pytest.mark.parametrize(
    "split",
    [
        dict(micro_batch_size=1),
        dict(micro_batch_size=None, max_tokens_per_micro_batch=13, pack_sequences=True),
    ],
    ids=["rows-of-1", "packed-budget-13"],
)
def test_engine_decoupled_loss_is_split_invariant(split) -> None:
    """The actor engine's step with the decoupled objective: same loss, metrics and gradients
    for the whole mini-batch in one micro-batch and split into rows of 1 or a packed budget."""
    batch = make_batch(B, 10, padding="mixed", seed=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    stale = 0.5 * torch.randn(batch["old_logprobs"].shape, dtype=torch.float64, generator=gen)
    batch["rollout_logprobs"] = torch.where(
        batch["loss_mask"], batch["old_logprobs"] - stale, torch.zeros_like(stale)
    )
    state = tiny_model("qwen2", dtype=torch.float64).state_dict()
    policy = PolicyLossConfig(decoupled_is_cap=CAP)

    def engine(**config) -> ActorEngine:
        model = tiny_model("qwen2", dtype=torch.float64)
        model.load_state_dict(state)
        return ActorEngine(model, ActorConfig(temperature=0.9, policy_loss=policy, **config))

    whole = engine(micro_batch_size=B)
    reference = whole.forward_backward_batch(batch)
    assert 0 < reference["metrics"]["decoupled_is_capped_frac"] < 1
    ref_grads = grads_of(whole.module)
    split_engine = engine(**split)
    result = split_engine.forward_backward_batch(batch)
    assert abs(result["loss"] - reference["loss"]) <= 1e-7 + 2e-6 * abs(reference["loss"])
    assert_close_dicts(result["metrics"], reference["metrics"], rtol=2e-6, atol=1e-7)
    assert_close_dicts(grads_of(split_engine.module), ref_grads, rtol=1e-9, atol=1e-12)
