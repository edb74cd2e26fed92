"""Importance-sampling-corrected KL, ``policy_loss.kl_is_correction`` (docs/losses.md#importance-sampling-corrected-kl-kl_is_correction).

DeepSeek-V3.2's unbiased KL estimate (TRL's ``use_bias_correction_kl``): the per-token KL times
the unclipped, non-detached ratio ``pi / pi_old``, per token, or the GSPO sequence ratio
``exp(mean_t log(pi / pi_old))`` for ``name='gspo'``; then aggregated like the plain KL term.

Loss level: against a float64 reference written here from the formula (loss, gradient w.r.t. the
log-probs, metrics) for every aggregation mode, token and sequence ratio, k1 and k3, with
NaN/inf at masked positions and an upstream gradient other than 1; off by default and then
bit-identical to the uncorrected term; exact under micro-batch and data-parallel splits; the
correction makes the gradient the true ``KL(pi || ref)`` gradient under samples of ``pi_old``
(exact expectation over a small vocabulary); bad values rejected naming the key.

Engine level: ``ActorEngine`` with the fused head, ``fuse_loss=True`` against ``False``, and
across micro-batch sizes and packing: same loss, metrics and parameter gradients.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_utils import VOCAB, tiny_model
from loss_utils import leaf
from loss_utils import make_batch as shared_batch
from tensordict import TensorDict

from microrl.configs import ActorConfig
from microrl.configs.loader import load_config
from microrl.engine import ActorEngine
from microrl.losses import (
    AggMode,
    KLEstimator,
    PolicyLossConfig,
    aggregate,
    global_denominators,
    kl_penalty,
    policy_loss,
    reduce_metrics,
)

MODES = [m.value for m in AggMode]
SEQ_LEN_NORM = 24.0
B, T = 7, 24
# [start, stop) of each row's loss tokens: a length-1 response, an all-masked row, both paddings
SPANS = [(23, 24), (1, 24), (0, 0), (10, 15), (0, 17), (3, 5), (6, 17)]
# Per-dtype tolerances of the loss and gradient against the float64 reference.
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-14), torch.float32: dict(rtol=1e-5, atol=1e-6)}
# k3's clamp and cap, restated here (docs/losses.md): the reference is written from the docs.
LOG_R_CLAMP, K3_CAP = 20.0, 10.0


def make_batch(seed: int = 0, dtype: torch.dtype = torch.float64) -> dict:
    """The loss tests' batch on these rows: NaN, inf or -inf at every masked position."""
    return shared_batch(dtype, seed, batch=B, length=T, spans=SPANS)


# ----------------------------------------------------------------------------- the reference
def reference_loss(lp, batch, *, estimator, sequence_level, mode, kl_coef):
    """``kl_coef * agg((pi / pi_old) * k)`` in float64 from the formula; ``lp`` a clean leaf."""
    mask = batch["loss_mask"]
    m = mask.double()

    def clean(t):
        return torch.where(mask, t.double(), 0.0)

    old, ref = clean(batch["old_logprobs"]), clean(batch["ref_logprobs"])
    log_r = lp - ref
    if estimator == "k1":
        k = log_r
    else:
        c = log_r.clamp(-LOG_R_CLAMP, LOG_R_CLAMP)
        k = (torch.exp(-c) - 1 + c).clamp(max=K3_CAP)
    token_log_ratio = (lp - old).clamp(-LOG_R_CLAMP, LOG_R_CLAMP) * m
    if sequence_level:
        n = m.sum(1, keepdim=True).clamp_min(1)
        ratio = torch.exp(token_log_ratio.sum(1, keepdim=True) / n).expand(B, T)
    else:
        ratio = torch.exp(token_log_ratio)
    per_token = ratio * k * m
    n_tokens = m.sum().clamp_min(1)
    n_seqs = mask.any(1).double().sum().clamp_min(1)
    if mode == "token-mean":
        agg = per_token.sum() / n_tokens
    elif mode == "seq-mean-token-sum":
        agg = per_token.sum() / n_seqs
    elif mode == "seq-mean-token-mean":
        agg = (per_token.sum(1) / m.sum(1).clamp_min(1)).sum() / n_seqs
    else:
        agg = per_token.sum() / (n_seqs * SEQ_LEN_NORM)
    token_mean = per_token.sum() / n_tokens
    return kl_coef * agg, agg, token_mean


def call(config, batch, lp, mode, denominators=None, rows=None):
    sl = batch if rows is None else {k: v[torch.tensor(rows)] for k, v in batch.items()}
    if rows is not None:
        lp = lp[torch.tensor(rows)]
    if denominators is None:
        denominators = global_denominators(sl["loss_mask"], seq_len_norm=SEQ_LEN_NORM)
    return policy_loss(
        lp,
        sl["old_logprobs"],
        sl["advantages"],
        sl["loss_mask"],
        denominators,
        config,
        mode,
        ref_logprobs=sl["ref_logprobs"],
    )


NAMES = {"token": "ppo", "sequence": "gspo"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("estimator", ["k3", "k1"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_float64_reference(mode, level, estimator, dtype) -> None:
    """Zero advantages leave only the KL term: loss, gradient and metrics against the formula."""
    batch = make_batch(seed=MODES.index(mode), dtype=dtype)
    mask = batch["loss_mask"]
    batch["advantages"] = torch.where(mask, 0.0, batch["advantages"])
    kl_coef = 0.3
    config = PolicyLossConfig(
        name=NAMES[level], kl_coef=kl_coef, kl_estimator=estimator, kl_is_correction=True
    )
    lp = leaf(batch["logprobs"])
    loss, metrics = call(config, batch, lp, mode)
    loss.backward(torch.tensor(2.5, dtype=loss.dtype))  # upstream gradient != 1
    assert loss.dtype == dtype and torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask] == 0).all()  # garbage at masked positions never leaks

    ref_lp = leaf(torch.where(mask, batch["logprobs"].double(), 0.0))
    want, want_agg, want_mean = reference_loss(
        ref_lp,
        batch,
        estimator=estimator,
        sequence_level=level == "sequence",
        mode=mode,
        kl_coef=kl_coef,
    )
    (want * 2.5).backward()
    assert ref_lp.grad[mask].abs().max() > 0
    torch.testing.assert_close(loss.double(), want.detach(), **TOL[dtype])
    torch.testing.assert_close(lp.grad.double(), ref_lp.grad, **TOL[dtype])

    log = reduce_metrics([metrics])
    plain = kl_penalty(
        ref_lp.detach(), torch.where(mask, batch["ref_logprobs"].double(), 0.0), estimator
    )
    want_kl = (plain * mask).sum() / mask.sum()
    assert log["kl"] == pytest.approx(want_kl.item(), rel=1e-5)  # the uncorrected mean
    assert log["kl_is"] == pytest.approx(want_mean.item(), rel=1e-5)  # the corrected mean
    assert log["kl_loss"] == pytest.approx(want_agg.item(), rel=1e-5)  # the aggregated term
    assert log["pg_loss"] == 0.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_only_the_kl_term_changes(name, mode) -> None:
    """With advantages: on - off = kl_coef * (agg(ratio * kl) - agg(kl)), in value and gradient."""
    batch = make_batch(seed=3)
    mask = batch["loss_mask"]
    base = PolicyLossConfig(name=name, kl_coef=0.2)
    results = {}
    for on in (False, True):
        lp = leaf(batch["logprobs"])
        loss, metrics = call(dataclasses.replace(base, kl_is_correction=on), batch, lp, mode)
        loss.backward()
        results[on] = (loss.detach(), lp.grad, reduce_metrics([metrics]))
    diffs = []
    for corrected in (False, True):
        ref_lp = leaf(torch.where(mask, batch["logprobs"], 0.0))
        if corrected:
            _, agg, _ = reference_loss(
                ref_lp, batch, estimator="k3", sequence_level=name == "gspo", mode=mode, kl_coef=1
            )
        else:
            ref = torch.where(mask, batch["ref_logprobs"], 0.0)
            dens = global_denominators(mask, seq_len_norm=SEQ_LEN_NORM)
            agg = aggregate(kl_penalty(ref_lp, ref, "k3"), mask, mode, dens)
        (0.2 * agg).backward()
        diffs.append((0.2 * agg.detach(), ref_lp.grad))
    torch.testing.assert_close(
        results[True][0] - results[False][0], diffs[1][0] - diffs[0][0], rtol=1e-10, atol=1e-14
    )
    torch.testing.assert_close(
        results[True][1] - results[False][1], diffs[1][1] - diffs[0][1], rtol=1e-10, atol=1e-14
    )
    for key in ("pg_loss", "kl", "ppo_kl", "pg_clipfrac", "ratio_min", "ratio_max"):
        assert results[True][2][key] == results[False][2][key], key


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", list(KLEstimator))
def test_off_by_default_and_then_unchanged(estimator, mode) -> None:
    """Off (the default), the KL term is exactly today's ``kl_coef * agg(kl_penalty)``, bit for
    bit, and there is no ``kl_is`` metric."""
    assert PolicyLossConfig().kl_is_correction is False
    batch = make_batch(seed=5, dtype=torch.float32)
    mask = batch["loss_mask"]
    batch["advantages"] = torch.where(mask, 0.0, batch["advantages"])
    config = PolicyLossConfig(name="gspo", kl_coef=0.7, kl_estimator=estimator)
    lp = leaf(batch["logprobs"])
    loss, metrics = call(config, batch, lp, mode)
    loss.backward()
    clean_lp = leaf(torch.where(mask, batch["logprobs"], 0.0))
    ref = torch.where(mask, batch["ref_logprobs"], 0.0)
    dens = global_denominators(mask, seq_len_norm=SEQ_LEN_NORM)
    today = 0.7 * aggregate(kl_penalty(clean_lp, ref, estimator), mask, mode, dens)
    today.backward()
    assert torch.equal(loss.detach(), today.detach() + 0.0)
    assert torch.equal(lp.grad, clean_lp.grad)
    assert "kl_is" not in metrics and "kl" in metrics


# ----------------------------------------------------------------------------- exact under splits
SPLITS = {
    "1": [[list(range(B))]],
    "2": [[[0, 1, 2, 3], [4, 5, 6]]],
    "3-permuted": [[[5, 0], [3, 6, 2], [1, 4]]],
    "B": [[[i] for i in range(B)]],
    "dp2": [[[0, 2], [4, 6]], [[1, 3, 5]]],
    "dp3": [[[6]], [[0, 1], [2]], [[3], [4], [5]]],
}
SPLIT_CONFIGS = {
    "ppo-k3": PolicyLossConfig(name="ppo", kl_coef=0.1, kl_is_correction=True),
    "gspo-k3": PolicyLossConfig(
        name="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05, kl_coef=0.1, kl_is_correction=True
    ),
    "cispo-k1": PolicyLossConfig(
        name="cispo", kl_coef=0.05, kl_estimator="k1", kl_is_correction=True
    ),
}


def run_split(config, batch, ranks, mode):
    """Partial losses summed per rank; gradients averaged over ranks (with ``grad_scale = W``)."""
    world = len(ranks)
    dens = global_denominators(batch["loss_mask"], seq_len_norm=SEQ_LEN_NORM)
    dens = dataclasses.replace(dens, grad_scale=float(world))
    grad = torch.zeros(B, T, dtype=torch.float64)
    total, all_metrics = 0.0, []
    for micro_batches in ranks:
        lp = leaf(batch["logprobs"])
        for rows in micro_batches:
            loss, metrics = call(config, batch, lp, mode, dens, rows)
            loss.backward(torch.tensor(0.5, dtype=loss.dtype))
            total += loss.item()
            all_metrics.append(metrics)
        grad += lp.grad / world
    return total / world, grad, reduce_metrics(all_metrics)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SPLIT_CONFIGS))
def test_exact_under_micro_batch_and_dp_splits(name, mode) -> None:
    batch = make_batch(seed=11)
    config = SPLIT_CONFIGS[name]
    full_loss, full_grad, full_metrics = run_split(config, batch, SPLITS["1"], mode)
    assert "kl_is" in full_metrics and full_grad.abs().sum() > 0
    for split, ranks in SPLITS.items():
        loss, grad, metrics = run_split(config, batch, ranks, mode)
        assert loss == pytest.approx(full_loss, rel=1e-12, abs=1e-14), split
        assert torch.isfinite(grad).all() and (grad[~batch["loss_mask"]] == 0).all(), split
        torch.testing.assert_close(grad, full_grad, rtol=1e-12, atol=1e-14, msg=split)
        assert metrics.keys() == full_metrics.keys()
        for key, value in full_metrics.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (split, key)


# ----------------------------------------------------------------------------- why: unbiased
@pytest.mark.parametrize("estimator", ["k3", "k1"])
def test_gradient_is_the_kl_gradient_under_old_policy_samples(estimator) -> None:
    """Over a 6-token vocabulary, the exact expectation under ``pi_old`` of the corrected term
    is ``KL(pi || ref)`` and its gradient is ``grad KL(pi || ref)``; uncorrected it is not."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    theta = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True)
    log_old = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64), 0)
    log_ref = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64), 0)
    one = torch.ones(1, 1, dtype=torch.bool)
    dens = global_denominators(one)

    def expected_term(corrected):
        log_pi = torch.log_softmax(theta, 0)
        config = PolicyLossConfig(kl_coef=1.0, kl_estimator=estimator, kl_is_correction=corrected)
        total = 0
        for y in range(vocab):  # each sampled token a one-token row; weight by pi_old(y)
            pick = lambda t, y=y: t[y].reshape(1, 1)  # noqa: E731
            zero = torch.zeros(1, 1, dtype=torch.float64)
            loss, _ = policy_loss(
                pick(log_pi),
                pick(log_old),
                zero,
                one,
                dens,
                config,
                "token-mean",
                ref_logprobs=pick(log_ref),
            )
            total = total + log_old[y].exp() * loss
        return total

    log_pi = torch.log_softmax(theta, 0)
    kl = (log_pi.exp() * (log_pi - log_ref)).sum()
    want_grad = torch.autograd.grad(kl, theta)[0]
    value = expected_term(True)
    got_grad = torch.autograd.grad(value, theta)[0]
    torch.testing.assert_close(value, kl.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)
    plain_grad = torch.autograd.grad(expected_term(False), theta)[0]
    assert (plain_grad - want_grad).abs().max() > 1e-3  # off-policy, uncorrected: biased


# ----------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("value", ["yes", 1, 0, None, 1.0])
def test_non_bool_is_rejected_naming_the_key(value) -> None:
    with pytest.raises(ValueError, match=r"policy_loss\.kl_is_correction must be a bool"):
        PolicyLossConfig(kl_is_correction=value)
    config = PolicyLossConfig(kl_coef=0.1)
    config.kl_is_correction = value  # mutated after construction: caught on the next call
    batch = make_batch()
    with pytest.raises(ValueError, match=r"policy_loss\.kl_is_correction"):
        call(config, batch, batch["logprobs"], "token-mean")


@pytest.mark.parametrize("estimator", ["k2", "k1+", "k3+"])
def test_k2_gradient_estimators_are_rejected(estimator) -> None:
    with pytest.raises(ValueError, match=r"kl_is_correction.*kl_estimator.*'k1' or 'k3'"):
        PolicyLossConfig(kl_estimator=estimator, kl_is_correction=True)
    PolicyLossConfig(kl_estimator=estimator, kl_is_correction=False)


def test_config_file_and_overrides() -> None:
    cfg = load_config(ActorConfig, None, ["policy_loss.kl_is_correction=true"])
    assert cfg.policy_loss.kl_is_correction is True
    with pytest.raises(ValueError, match="kl_is_correction"):
        load_config(ActorConfig, None, ["policy_loss.kl_is_correction=sometimes"])
    with pytest.raises(ValueError, match="kl_is_correction"):
        load_config(
            ActorConfig,
            None,
            ["policy_loss.kl_is_correction=true", "policy_loss.kl_estimator=k2"],
        )


# ----------------------------------------------------------------------------- engine level
ENGINE_LOSSES = {
    "grpo-k3": dict(policy_loss=PolicyLossConfig(name="grpo", kl_coef=0.1, kl_is_correction=True)),
    "gspo-k3-seq-mean": dict(
        policy_loss=PolicyLossConfig(
            name="gspo",
            clip_ratio_low=0.05,
            clip_ratio_high=0.05,
            kl_coef=0.1,
            kl_is_correction=True,
        ),
        loss_agg_mode="seq-mean-token-mean",
    ),
    "cispo-k1-token-sum-norm": dict(
        policy_loss=PolicyLossConfig(
            name="cispo", kl_coef=0.2, kl_estimator="k1", kl_is_correction=True
        ),
        loss_agg_mode="seq-mean-token-sum-norm",
        seq_len_norm=16.0,
    ),
}
ENGINE_SPLITS = {
    "mbs6": dict(micro_batch_size=6),
    "mbs2-chunk8": dict(micro_batch_size=2, kernel_chunk_size=8),
    "packed-budget": dict(max_tokens_per_micro_batch=17, pack_sequences=True),
}
# float64 model: the paths differ only in summation order (row groups, BLAS blocking); the
# reported loss and metrics are float32.
GRAD_RTOL, GRAD_ATOL = 1e-9, 1e-12
RTOL, ATOL = 2e-6, 1e-7


def engine_batch(dtype=torch.float64) -> TensorDict:
    """6 rows of 12 tokens, left/right/two-sided padding; the last half of each row trains.
    Old log-probs near the model's own (~ -4.85 for V=128) so the ratios straddle 1."""
    g = torch.Generator().manual_seed(5)
    lengths, width = [12, 5, 9, 3, 11, 7], 12
    attn = torch.zeros(6, width, dtype=torch.bool)
    loss_mask = torch.zeros_like(attn)
    for b, n in enumerate(lengths):
        start = (width - n, 0, (width - n) // 2)[b % 3]
        attn[b, start : start + n] = True
        loss_mask[b, start + max(1, n // 2) : start + n] = True

    def rand(scale):
        return scale * torch.randn(6, width, generator=g, dtype=torch.float64)

    old = -4.85 + rand(0.3)
    return TensorDict(
        input_ids=torch.randint(0, VOCAB, (6, width), generator=g),
        attention_mask=attn,
        loss_mask=loss_mask,
        advantages=rand(1.0).to(dtype),
        old_logprobs=old.to(dtype),
        ref_logprobs=(old + rand(0.3)).to(dtype),
        batch_size=[6],
    )


def engine_run(name, fuse, split):
    config = ActorConfig(fuse_loss=fuse, use_fused_kernel=True, **ENGINE_LOSSES[name], **split)
    engine = ActorEngine(tiny_model(seed=2, dtype=torch.float64), config)
    assert engine.uses_fused_kernel and engine.fuses_loss(None) is fuse
    result = engine.forward_backward_batch(engine_batch())
    grads = {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }
    return result, grads


def assert_same(a, b) -> None:
    (res_a, grads_a), (res_b, grads_b) = a, b
    assert abs(res_a["loss"] - res_b["loss"]) <= ATOL + RTOL * abs(res_b["loss"])
    assert res_a["metrics"].keys() == res_b["metrics"].keys()
    for key, want in res_b["metrics"].items():
        got = res_a["metrics"][key]
        assert abs(got - want) <= ATOL + RTOL * abs(want), f"{key}: {got} vs {want}"
    assert grads_a.keys() == grads_b.keys()
    for key, want in grads_b.items():
        worst = (grads_a[key] - want).abs().max().item()
        assert torch.allclose(grads_a[key], want, rtol=GRAD_RTOL, atol=GRAD_ATOL), (key, worst)


@pytest.mark.parametrize("name", list(ENGINE_LOSSES))
def test_engine_fused_equals_unfused_and_split_invariant(name) -> None:
    reference = engine_run(name, False, ENGINE_SPLITS["mbs6"])
    metrics = reference[0]["metrics"]
    assert "kl_is" in metrics and metrics["kl_is"] != metrics["kl"]
    assert any(g.abs().max() > 0 for g in reference[1].values())
    for split in ENGINE_SPLITS.values():
        for fuse in (True, False):
            assert_same(engine_run(name, fuse, split), reference)


def test_engine_kl_term_is_the_corrected_one() -> None:
    """The engine's reported loss moves by exactly the KL term's change when the flag flips."""
    split = ENGINE_SPLITS["mbs2-chunk8"]
    on = engine_run("grpo-k3", True, split)[0]
    off_losses = dict(policy_loss=PolicyLossConfig(name="grpo", kl_coef=0.1))
    config = ActorConfig(fuse_loss=True, **off_losses, **split)
    off = ActorEngine(tiny_model(seed=2, dtype=torch.float64), config).forward_backward_batch(
        engine_batch()
    )
    assert "kl_is" not in off["metrics"]
    assert on["metrics"]["kl"] == pytest.approx(off["metrics"]["kl"], rel=1e-6)
    assert on["metrics"]["pg_loss"] == pytest.approx(off["metrics"]["pg_loss"], rel=1e-6)
    moved = on["loss"] - off["loss"]
    want = 0.1 * (on["metrics"]["kl_loss"] - off["metrics"]["kl_loss"])
    assert moved == pytest.approx(want, rel=1e-5, abs=1e-7)
