"""Rollout/trainer log-prob mismatch: metrics and corrections (losses/mismatch.py, docs/losses.md).

References are worked out in the tests with plain Python floats (float64); the library's
metrics are float32 by the metrics contract, hence the relative tolerance ``RTOL``.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_utils import assert_close_dicts, grads_of, make_batch, tiny_model

from microrl.configs import ActorConfig, PolicyLossConfig
from microrl.engine import ActorEngine
from microrl.losses import (
    MISMATCH_METRICS,
    global_denominators,
    mismatch_metrics,
    policy_loss,
    reduce_metrics,
    rollout_correction,
)

RTOL = 1e-6  # float32 metric values
NAN, INF = float("nan"), float("inf")


def _explicit_batch():
    """Three rows: three loss tokens, one loss token, none. NaN/inf off the loss mask."""
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    train = torch.tensor(
        [[NAN, -1.0, -0.5, -2.0], [0.0, 0.0, -0.3, NAN], [INF, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    rollout = torch.tensor(
        [[INF, -1.2, -0.5, -1.0], [0.0, 0.0, -0.1, -INF], [0.0, NAN, 0.0, 0.0]],
        dtype=torch.float64,
    )
    return train, rollout, mask


def _by_hand(train, rollout, mask) -> dict[str, float]:
    deltas = [
        float(train[b, t]) - float(rollout[b, t])
        for b in range(mask.shape[0])
        for t in range(mask.shape[1])
        if mask[b, t]
    ]
    n = len(deltas)
    return {
        "mismatch/abs_diff_mean": sum(abs(d) for d in deltas) / n,
        "mismatch/abs_diff_max": max(abs(d) for d in deltas),
        # k3 of KL(rollout || train), r = pi_train / pi_rollout: r - 1 - log r
        "mismatch/kl_k3": sum(math.exp(d) - 1 - d for d in deltas) / n,
        "mismatch/mult_prob_error": sum(math.exp(abs(d)) for d in deltas) / n,
    }


def _assert_metrics(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for name, value in expected.items():
        assert abs(actual[name] - value) <= 1e-9 + RTOL * abs(value), (name, actual[name], value)


@pytest.mark.parametrize("rows", [[[0, 1, 2]], [[0], [1], [2]], [[2], [1, 0]]], ids=str)
def test_metrics_match_a_hand_computation_under_any_split(rows) -> None:
    train, rollout, mask = _explicit_batch()
    # deltas 0.2, 0.0, -1.0 (row 0) and -0.2 (row 1)
    expected = _by_hand(train, rollout, mask)
    assert expected["mismatch/abs_diff_mean"] == pytest.approx(0.35)
    assert expected["mismatch/abs_diff_max"] == pytest.approx(1.0)
    denominators = global_denominators(mask)
    parts = [
        mismatch_metrics(train[r], rollout[r], mask[r], denominators, validate=True) for r in rows
    ]
    _assert_metrics(reduce_metrics(parts), expected)


def test_k3_estimates_kl_from_the_rollout_to_the_trainer() -> None:
    """Tokens drawn from the rollout policy mu: mean k3 -> KL(mu || pi_train), not KL(pi || mu)."""
    mu = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05], dtype=torch.float64)
    pi = torch.full((5,), 0.2, dtype=torch.float64)
    tokens = torch.multinomial(
        mu, 200_000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    train, rollout = pi.log()[tokens][None], mu.log()[tokens][None]
    mask = torch.ones_like(train, dtype=torch.bool)
    got = reduce_metrics([mismatch_metrics(train, rollout, mask, global_denominators(mask))])
    kl_mu_pi = float((mu * (mu / pi).log()).sum())  # 0.3378
    kl_pi_mu = float((pi * (pi / mu).log()).sum())  # 0.4054
    assert abs(got["mismatch/kl_k3"] - kl_mu_pi) < 0.01
    assert abs(got["mismatch/kl_k3"] - kl_pi_mu) > 0.05


def test_identical_logprobs_report_no_mismatch() -> None:
    lp = -torch.rand(3, 5, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    got = reduce_metrics([mismatch_metrics(lp, lp.clone(), mask, global_denominators(mask))])
    _assert_metrics(
        got,
        {
            "mismatch/abs_diff_mean": 0.0,
            "mismatch/abs_diff_max": 0.0,
            "mismatch/kl_k3": 0.0,
            "mismatch/mult_prob_error": 1.0,
        },
    )


def _ratio_batch():
    """old - rollout = log of these ratios on the loss tokens (row 2: none)."""
    ratios = [[1.0, 0.4, 0.9, 1.1, 2.5], [1.0, 1.0, 1.05, 0.95, 1.0], [1.0, 3.0, 1.0, 1.0, 1.0]]
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    rollout = -torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    old = rollout + torch.tensor(ratios, dtype=torch.float64).log()
    return old, rollout, mask, ratios


def test_corrections_mask_the_expected_tokens_and_sequences() -> None:
    old, rollout, mask, ratios = _ratio_batch()
    denominators = global_denominators(mask)  # 7 loss tokens, 2 loss sequences
    # Row 0: geometric mean (0.4 * 0.9 * 1.1 * 2.5) ** (1/4) = 0.99 -> kept; row 1: 1.0 -> kept.
    band = rollout_correction(old, rollout, mask, denominators, token_band=(0.5, 2.0))
    assert band.token_masked.tolist() == [
        [False, True, False, False, True],
        [False] * 5,
        [False] * 5,
    ]
    expected = [[0.0, 0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0, 1.0], [0.0] * 5]
    torch.testing.assert_close(band.weights, torch.tensor(expected, dtype=torch.float64))
    assert float(band.metrics["mismatch/token_mask_frac"].value) == pytest.approx(2 / 7)

    # Row 0's per-token ratios but its tokens 3, 4 pushed up: geometric mean 1.33 -> masked.
    old_seq = old.clone()
    old_seq[0, 3:] += math.log(2.0)
    seq = rollout_correction(old_seq, rollout, mask, denominators, seq_band=(0.8, 1.25))
    assert seq.seq_masked.tolist() == [True, False, False]
    assert seq.weights[0].abs().sum() == 0 and (seq.weights[1, 2:] == 1).all()
    assert float(seq.metrics["mismatch/seq_mask_frac"].value) == pytest.approx(1 / 2)

    # IcePop's weight: r inside the band, 0 outside (= token band with tis_cap at its top).
    icepop = rollout_correction(
        old, rollout, mask, denominators, tis_cap=2.0, token_band=(0.5, 2.0)
    )
    want = [
        [r if (m and 0.5 <= r <= 2.0) else 0.0 for r, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(ratios, mask.tolist(), strict=True)
    ]
    torch.testing.assert_close(icepop.weights, torch.tensor(want, dtype=torch.float64))
    assert set(icepop.metrics) == {"tis_weight_mean", "tis_clipfrac", "mismatch/token_mask_frac"}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_masked_tokens_get_zero_gradient_and_keep_the_denominators(mode) -> None:
    """A correction mask is the loss with those tokens' advantages zeroed: same value, same
    gradient, same denominators (masked tokens still count in N_tokens)."""
    old, rollout, mask, _ = _ratio_batch()
    # ratios row 0: 0.4, 0.9, 2.2, 5.0 (tokens 1, 4 out of the token band; geometric mean 1.41:
    # out of the sequence band), row 1: 1.05, 0.95, 0.4 (token 4 out; geometric mean 0.74: in)
    old[0, 3:] += math.log(2.0)
    old[1, 4] -= math.log(2.5)
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(3, 5, dtype=torch.float64, generator=gen)
    logprobs = (old + 0.05 * torch.randn(3, 5, dtype=torch.float64, generator=gen)).requires_grad_()
    denominators = global_denominators(mask)
    corrected = PolicyLossConfig(token_ratio_band=(0.5, 2.5), seq_ratio_band=(0.5, 1.2))
    loss, metrics = policy_loss(
        logprobs, old, advantages, mask, denominators, corrected, mode, rollout_logprobs=rollout
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    masked = torch.zeros_like(mask)
    masked[0] = mask[0]  # the whole of row 0 (sequence mask)
    masked[1, 4] = True
    assert (grad[masked] == 0).all() and (grad[mask & ~masked] != 0).all()
    assert float(metrics["mismatch/token_mask_frac"].value) == pytest.approx(3 / 7)
    assert float(metrics["mismatch/seq_mask_frac"].value) == pytest.approx(1 / 2)

    zeroed = torch.where(masked, torch.zeros_like(advantages), advantages)
    ref_loss, _ = policy_loss(logprobs, old, zeroed, mask, denominators, PolicyLossConfig(), mode)
    (ref_grad,) = torch.autograd.grad(ref_loss, logprobs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)


def test_policy_loss_without_rollout_logprobs_reports_no_mismatch() -> None:
    old, _, mask, _ = _ratio_batch()
    _, metrics = policy_loss(
        old.clone(),
        old,
        torch.ones_like(old),
        mask,
        global_denominators(mask),
        PolicyLossConfig(),
        "token-mean",
    )
    assert not any(name.startswith("mismatch/") for name in metrics)
    with pytest.raises(ValueError, match="rollout_logprobs is required"):
        policy_loss(
            old.clone(),
            old,
            torch.ones_like(old),
            mask,
            global_denominators(mask),
            PolicyLossConfig(seq_ratio_band=(0.5, 2.0)),
            "token-mean",
        )


# ------------------------------------------------------------------------------ the engine

B = 6
CORRECTED = dict(tis_cap=1.5, token_ratio_band=(0.7, 1.4), seq_ratio_band=(0.85, 1.15))


def _mismatch_batch(seed: int = 31):
    batch = make_batch(B, 10, padding="mixed", seed=seed, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    noise = 0.3 * torch.randn(batch["old_logprobs"].shape, dtype=torch.float64, generator=gen)
    batch["rollout_logprobs"] = torch.where(
        batch["loss_mask"], batch["old_logprobs"] + noise, torch.zeros_like(noise)
    )
    return batch


def _engine(state, **config) -> ActorEngine:
    model = tiny_model("qwen2", dtype=torch.float64)
    model.load_state_dict(state)
    return ActorEngine(model, ActorConfig(temperature=0.9, **config))


@pytest.mark.usefixtures("intra_op_threads")
@pytest.mark.parametrize(
    "split",
    [
        dict(micro_batch_size=1),
        dict(micro_batch_size=None, max_tokens_per_micro_batch=13, pack_sequences=True),
    ],
    ids=["rows-of-1", "packed-budget-13"],
)
def test_engine_mismatch_is_split_invariant(split) -> None:
    batch = _mismatch_batch()
    state = tiny_model("qwen2", dtype=torch.float64).state_dict()
    policy = PolicyLossConfig(**CORRECTED)
    # the batch exercises every correction
    check = rollout_correction(
        batch["old_logprobs"],
        batch["rollout_logprobs"],
        batch["loss_mask"],
        global_denominators(batch["loss_mask"]),
        token_band=CORRECTED["token_ratio_band"],
        seq_band=CORRECTED["seq_ratio_band"],
    )
    assert check.token_masked.any() and check.seq_masked.any()
    assert not check.seq_masked[batch["loss_mask"].any(dim=1)].all()

    whole = _engine(state, micro_batch_size=B, policy_loss=policy)
    reference = whole.forward_backward_batch(batch)
    ref_grads = grads_of(whole.module)
    split_engine = _engine(state, policy_loss=policy, **split)
    result = split_engine.forward_backward_batch(batch)
    assert abs(result["loss"] - reference["loss"]) <= 1e-7 + 2e-6 * abs(reference["loss"])
    assert_close_dicts(result["metrics"], reference["metrics"], rtol=2e-6, atol=1e-7)
    assert_close_dicts(grads_of(split_engine.module), ref_grads, rtol=1e-9, atol=1e-12)
    expected = _by_hand(batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"])
    _assert_metrics({k: result["metrics"][k] for k in MISMATCH_METRICS}, expected)
    for name in ("tis_weight_mean", "mismatch/token_mask_frac", "mismatch/seq_mask_frac"):
        assert name in result["metrics"]
    assert result["metrics"]["mismatch/token_mask_frac"] > 0


def test_engine_reports_mismatch_for_a_custom_loss() -> None:
    """With old_logprobs: against them; without: against the trainer's current logprobs."""
    batch = _mismatch_batch(seed=32)
    state = tiny_model("qwen2", dtype=torch.float64).state_dict()
    engine = _engine(state, micro_batch_size=2)
    got = engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)["metrics"]
    _assert_metrics(
        {k: got[k] for k in MISMATCH_METRICS},
        _by_hand(batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"]),
    )
    del batch["old_logprobs"]
    result = engine.forward_backward_batch(batch, loss_fn=engine.sft_loss, forward_only=True)
    _assert_metrics(
        {k: result["metrics"][k] for k in MISMATCH_METRICS},
        _by_hand(result["model_output"]["logprobs"], batch["rollout_logprobs"], batch["loss_mask"]),
    )


def test_engine_without_rollout_logprobs_reports_no_mismatch() -> None:
    batch = make_batch(4, 10, seed=33)
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2))
    metrics = engine.forward_backward_batch(batch)["metrics"]
    assert metrics and not any(name.startswith("mismatch/") for name in metrics)
    metrics = engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)["metrics"]
    assert not any(name.startswith("mismatch/") for name in metrics)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda b: b.set("rollout_logprobs", b["rollout_logprobs"].long()),
            "'rollout_logprobs' must be a floating",
        ),
        (
            lambda b: b.set("rollout_logprobs", b["rollout_logprobs"][:, :-1]),
            "'rollout_logprobs' must have the shape",
        ),
        (
            lambda b: b.set("rollout_logprobs", torch.full_like(b["rollout_logprobs"], NAN)),
            "'rollout_logprobs' is not finite",
        ),
        (
            lambda b: b.exclude("rollout_logprobs"),
            r"missing required key\(s\) \['rollout_logprobs'\]",
        ),
    ],
    ids=["dtype", "shape", "nan", "missing"],
)
def test_bad_rollout_logprobs_are_rejected(mutate, message) -> None:
    batch = mutate(make_batch(4, 10, seed=34).set("rollout_logprobs", -torch.rand(4, 10)))
    engine = ActorEngine(
        tiny_model(), ActorConfig(policy_loss=PolicyLossConfig(token_ratio_band=(0.5, 2.0)))
    )
    with pytest.raises(ValueError, match=message):
        engine.forward_backward_batch(batch)


def test_bad_bands_and_inputs_are_rejected() -> None:
    for band in [(2.0, 0.5), (0.5,), (-0.1, 2.0), "0.5,2", (NAN, 1.0)]:
        with pytest.raises(ValueError, match=r"policy_loss\.token_ratio_band"):
            PolicyLossConfig(token_ratio_band=band)
        with pytest.raises(ValueError, match=r"policy_loss\.seq_ratio_band"):
            PolicyLossConfig(seq_ratio_band=band)
    assert PolicyLossConfig(seq_ratio_band=[0.0, INF]).seq_ratio_band == (0.0, INF)
    train, rollout, mask = _explicit_batch()
    denominators = global_denominators(mask)
    with pytest.raises(ValueError, match="seq_band"):
        rollout_correction(train, rollout, mask, denominators, seq_band=(1.0, 1.0))
    with pytest.raises(ValueError, match="rollout_logprobs must have the shape"):
        mismatch_metrics(train, rollout[:, :-1], mask, denominators)
    bad = rollout.clone()
    bad[0, 2] = NAN
    with pytest.raises(ValueError, match="rollout_logprobs has 1 non-finite"):
        mismatch_metrics(train, bad, mask, denominators)
