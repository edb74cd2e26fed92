"""Policy, KL, entropy, value and SFT losses against readable per-token reference loops.

The references below visit only unmasked tokens, one Python scalar at a time, and aggregate with
explicit loops, so they are obviously correct; the batches put NaN/inf at every masked position,
so agreement also proves that masked garbage reaches neither loss, metric nor gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_utils import SEQ_LEN_NORM, denominators_for, leaf, make_batch, num

from microrl.losses import (
    K3_MAX,
    LOG_RATIO_CLAMP,
    MISMATCH_METRICS,
    AggMode,
    KLEstimator,
    PolicyLossConfig,
    PolicyLossType,
    entropy_bonus,
    kl_penalty,
    policy_loss,
    sft_loss,
    value_loss,
)

MODES = [m.value for m in AggMode]
# (dtype, rtol, atol) of our result against the float64 reference. Metrics are float32 always.
DTYPES = [(torch.float64, 1e-10, 1e-12), (torch.float32, 2e-5, 2e-6)]
METRIC_TOL = dict(rtol=2e-5, atol=2e-6)


# --------------------------------------------------------------------------- batch + reference


def ref_aggregate(per_token: dict, mask: torch.Tensor, mode: str, seq_len_norm: float | None):
    """sum over the unmasked tokens with explicit loops; per_token maps (b, t) -> scalar."""
    rows = [[t for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]
    n_tokens = max(sum(len(r) for r in rows), 1)
    n_seqs = max(sum(1 for r in rows if r), 1)
    total = 0.0
    for b, ts in enumerate(rows):
        row_sum = sum((per_token[(b, t)] for t in ts), 0.0)
        if mode == "token-mean":
            total = total + row_sum / n_tokens
        elif mode == "seq-mean-token-sum":
            total = total + row_sum / n_seqs
        elif mode == "seq-mean-token-mean":
            total = total + (row_sum / len(ts) if ts else 0.0) / n_seqs
        else:
            total = total + row_sum / (n_seqs * seq_len_norm)
    return total


def ref_kl(lp, ref, estimator: str):
    """Per-token KL estimate on 0-d tensors, written from the formulas."""
    log_r = lp - ref
    k2 = 0.5 * log_r**2
    k3 = torch.clamp(torch.exp(ref - lp) - 1 + log_r, max=K3_MAX)
    value = {"k1": log_r, "k2": k2, "k3": k3, "k1+": log_r, "k3+": k3}[estimator]
    if estimator.endswith("+"):  # straight-through: value of the estimator, gradient of k2
        return k2 + (value - k2).detach()
    return value


def clip(x, low, high):
    return torch.clamp(x, low, high)


def ref_policy(batch: dict, cfg: PolicyLossConfig, mode: str, leaves: dict):
    """Reference loss (with autograd through ``leaves``) and metrics of policy_loss."""
    mask = batch["loss_mask"]
    lp_all, ent_all = leaves["logprobs"], leaves["entropy"]
    old_all, adv_all = batch["old_logprobs"].double(), batch["advantages"].double()
    low, high = 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high
    pg, kl, ent = {}, {}, {}
    lower = upper = dual = 0
    ratios, ppo_kl = [], 0.0
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t]]
        seq_lr = sum((lp_all[b, t] - old_all[b, t]).item() for t in ts) / max(len(ts), 1)
        for t in ts:
            lp, old, a = lp_all[b, t], old_all[b, t], float(adv_all[b, t])
            if cfg.name is PolicyLossType.GSPO:
                # token-level GSPO: value exp(sequence mean log-ratio), gradient via this token
                ratio = math.exp(seq_lr) * torch.exp(lp - lp.detach())
                loss = torch.maximum(-a * ratio, -a * clip(ratio, low, high))
                r = math.exp(seq_lr)
                upper += a > 0 and r > high
                lower += a < 0 and r < low
                ppo_kl += -seq_lr
            elif cfg.name is PolicyLossType.CISPO:
                r = math.exp(num(lp - old))
                loss = -min(max(r, low), high) * a * lp
                upper += a != 0 and r > high
                lower += a != 0 and r < low
                ppo_kl += num(old - lp)
            elif cfg.name is PolicyLossType.REINFORCE:
                r = math.exp(num(lp - old))
                loss = -a * lp
                ppo_kl += num(old - lp)
            else:  # PPO / GRPO
                ratio = torch.exp(lp - old)
                r = num(ratio)
                loss = torch.maximum(-a * ratio, -a * clip(ratio, low, high))
                if a < 0 and cfg.clip_ratio_c is not None:
                    loss = torch.minimum(
                        loss, torch.tensor(-a * cfg.clip_ratio_c, dtype=torch.float64)
                    )
                    dual += r > cfg.clip_ratio_c
                upper += a > 0 and r > high
                lower += a < 0 and r < low
                ppo_kl += num(old - lp)
            if cfg.tis_cap is not None:
                rollout = num(batch["rollout_logprobs"][b, t])
                loss = loss * min(math.exp(num(old) - rollout), cfg.tis_cap)
            pg[(b, t)] = loss
            kl[(b, t)] = ref_kl(lp, batch["ref_logprobs"][b, t].double(), cfg.kl_estimator.value)
            ent[(b, t)] = ent_all[b, t]
            ratios.append(r)
    n = max(int(mask.sum()), 1)
    pg_term = ref_aggregate(pg, mask, mode, SEQ_LEN_NORM)
    kl_term = ref_aggregate(kl, mask, mode, SEQ_LEN_NORM)
    ent_term = ref_aggregate(ent, mask, mode, SEQ_LEN_NORM)
    total = pg_term
    if cfg.kl_coef > 0:
        total = total + cfg.kl_coef * kl_term
    if cfg.entropy_coef > 0:  # otherwise entropy is only reported, and gets no gradient
        total = total - cfg.entropy_coef * ent_term
    metrics = {
        "pg_loss": num(pg_term),
        "pg_clipfrac": (lower + upper) / n,
        "pg_clipfrac_lower": lower / n,
        "pg_clipfrac_upper": upper / n,
        "ppo_kl": ppo_kl / n,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "kl": sum(num(v) for v in kl.values()) / n,
        "kl_loss": num(kl_term),
        "entropy": sum(num(v) for v in ent.values()) / n,
    }
    if cfg.name in (PolicyLossType.PPO, PolicyLossType.GRPO) and cfg.clip_ratio_c is not None:
        metrics["pg_clipfrac_dual"] = dual / n
    return total, metrics


def run_policy(batch: dict, cfg: PolicyLossConfig, mode: str, upstream: float = 0.7, **kw):
    leaves = {k: leaf(batch[k]) for k in ("logprobs", "entropy")}
    loss, metrics = policy_loss(
        leaves["logprobs"],
        batch["old_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        denominators_for(batch["loss_mask"]),
        cfg,
        mode,
        ref_logprobs=batch["ref_logprobs"],
        entropy=leaves["entropy"],
        rollout_logprobs=batch["rollout_logprobs"],
        **kw,
    )
    loss.backward(torch.tensor(upstream, dtype=loss.dtype))
    return loss, metrics, leaves


def assert_close(actual, expected, rtol, atol, what):
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    if not bool((err <= bound).all()):
        worst = int((err - bound).argmax())
        raise AssertionError(
            f"{what}: worst element {worst}: got {actual.flatten()[worst].item()!r}, "
            f"expected {expected.flatten()[worst].item()!r} (|err| {err.flatten()[worst].item():.3g})"
        )


# --------------------------------------------------------------------------- policy losses

CONFIGS = {
    "ppo-dual": PolicyLossConfig(name="ppo", clip_ratio_low=0.2, clip_ratio_high=0.28),
    "ppo-no-dual": PolicyLossConfig(name="ppo", clip_ratio_c=None, kl_coef=0.05),
    "grpo-kl-entropy": PolicyLossConfig(
        name="grpo", clip_ratio_c=1.5, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01
    ),
    "gspo": PolicyLossConfig(name="gspo", clip_ratio_low=0.05, clip_ratio_high=0.08),
    "cispo": PolicyLossConfig(name="cispo", clip_ratio_low=0.3, clip_ratio_high=0.2),
    "cispo-no-lower": PolicyLossConfig(name="cispo", clip_ratio_low=1e9, clip_ratio_high=0.2),
    "reinforce-k1+": PolicyLossConfig(name="reinforce", kl_coef=0.2, kl_estimator="k1+"),
    "ppo-tis-k3+": PolicyLossConfig(tis_cap=1.3, kl_coef=0.3, kl_estimator="k3+"),
    "ppo-k2-entropy": PolicyLossConfig(kl_coef=0.3, kl_estimator="k2", entropy_coef=0.05),
}


@pytest.mark.parametrize("dtype,rtol,atol", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_policy_loss_matches_reference(config_name, mode, dtype, rtol, atol):
    cfg = CONFIGS[config_name]
    batch = make_batch(dtype, seed=list(CONFIGS).index(config_name))
    loss, metrics, leaves = run_policy(batch, cfg, mode, upstream=0.7)
    ref_leaves = {k: leaf(batch[k]).double() for k in ("logprobs", "entropy")}
    ref_leaves = {k: v.detach().requires_grad_(True) for k, v in ref_leaves.items()}
    ref_loss, ref_metrics = ref_policy(batch, cfg, mode, ref_leaves)
    (0.7 * ref_loss).backward()

    assert loss.dtype == dtype
    assert_close(loss, ref_loss, rtol, atol, "loss")
    mask = batch["loss_mask"]
    for name in ("logprobs", "entropy"):
        grad, ref_grad = leaves[name].grad, ref_leaves[name].grad
        if ref_grad is None:  # entropy with entropy_coef == 0: only a (detached) metric
            assert grad is None, f"{name}.grad should be None"
            continue
        assert torch.isfinite(grad).all(), f"{name}.grad has non-finite entries"
        assert (grad[~mask] == 0).all(), f"{name}.grad nonzero at masked positions"
        assert_close(grad, ref_grad, rtol, atol, f"{name}.grad")
    # rollout_logprobs is passed: the mismatch metrics are checked in test_mismatch.py.
    assert set(metrics) == set(ref_metrics) | set(MISMATCH_METRICS) | (
        {"tis_weight_mean", "tis_clipfrac"} if cfg.tis_cap else set()
    )
    for name, expected in ref_metrics.items():
        metric = metrics[name]
        assert not metric.value.requires_grad
        assert_close(metric.value, expected, **METRIC_TOL, what=f"metric {name}")


def test_gspo_token_form_equals_sequence_objective():
    """With one advantage per sequence and seq-mean-token-mean, GSPO-token is the sequence-level
    GSPO objective of the paper: same value and same gradient."""
    batch = make_batch(torch.float64, seed=3)
    mask = batch["loss_mask"]
    per_seq = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.2], dtype=torch.float64)
    batch["advantages"] = torch.where(mask, per_seq[:, None], 0.0)
    cfg = PolicyLossConfig(name="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05)
    lp = leaf(batch["logprobs"])
    loss, _ = policy_loss(
        lp,
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        denominators_for(mask),
        cfg,
        "seq-mean-token-mean",
    )
    loss.backward()

    ref_lp = leaf(batch["logprobs"])
    terms = []
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t]]
        if not ts:
            continue
        s = torch.exp(sum(ref_lp[b, t] - batch["old_logprobs"][b, t] for t in ts) / len(ts))
        a = float(per_seq[b])
        terms.append(torch.maximum(-a * s, -a * torch.clamp(s, 0.95, 1.05)))
    ref = sum(terms) / len(terms)
    ref.backward()
    assert_close(loss, ref, 1e-12, 1e-12, "loss")
    assert_close(lp.grad, ref_lp.grad, 1e-10, 1e-12, "grad")


@pytest.mark.parametrize("name", [t.value for t in PolicyLossType])
def test_first_on_policy_step(name):
    """logprobs == old == ref: ratio exactly 1, no clipping, kl exactly 0 (every estimator)."""
    batch = make_batch(torch.float32, seed=1)
    for key in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        batch[key] = batch["logprobs"].clone()
    for estimator in KLEstimator:
        cfg = PolicyLossConfig(name=name, kl_coef=0.1, kl_estimator=estimator, tis_cap=2.0)
        loss, metrics, leaves = run_policy(batch, cfg, "token-mean")
        values = {k: m.value.item() for k, m in metrics.items()}
        assert values["ratio_min"] == 1.0 and values["ratio_max"] == 1.0
        mask = batch["loss_mask"]
        adv = batch["advantages"][mask].double()
        lp = batch["logprobs"][mask].double()
        # ratio 1: the clipped surrogates are -A; CISPO and REINFORCE are -A * logprob
        expected = -adv if name in ("ppo", "grpo", "gspo") else -adv * lp
        assert loss.item() == pytest.approx(expected.mean().item(), rel=1e-5)
        for key in ("pg_clipfrac", "pg_clipfrac_lower", "pg_clipfrac_upper", "ppo_kl", "kl"):
            assert values[key] == 0.0, (key, values[key])
        assert values["tis_weight_mean"] == pytest.approx(1.0, abs=1e-6)
        assert torch.isfinite(leaves["logprobs"].grad).all()


def test_dual_clip_and_asymmetric_clip_bind_only_for_their_sign():
    """Hand-made tokens: each clip binds exactly where documented, gradients are zero there."""
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 4.0, 4.0, 1.25, 0.85]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    lp = (old + ratio.log()).requires_grad_(True)
    mask = torch.ones_like(ratio, dtype=torch.bool)
    cfg = PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=3.0)
    loss, metrics = policy_loss(lp, old, adv, mask, denominators_for(mask), cfg, "token-mean")
    loss.backward()
    # token: 0 up-clipped(A>0, r>1.3), 1 free, 2 free, 3 low-clipped(A<0, r<0.9),
    #        4 dual(A<0, r>3), 5 up-clipped, 6 free (1.25 < 1.3), 7 low-clipped (0.85 < 0.9)
    expected_zero_grad = torch.tensor([[1, 0, 0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    assert ((lp.grad == 0) == expected_zero_grad).all(), lp.grad
    v = {k: m.value.item() for k, m in metrics.items()}
    assert v["pg_clipfrac_upper"] == pytest.approx(2 / 8)
    assert v["pg_clipfrac_lower"] == pytest.approx(2 / 8)
    assert v["pg_clipfrac"] == pytest.approx(4 / 8)
    assert v["pg_clipfrac_dual"] == pytest.approx(1 / 8)
    # the dual-clipped token contributes -A * c = 3
    per_token = [-1.3, 1.5, -0.5, 0.9, 3.0, -1.3, -1.25, 0.9]
    assert loss.item() == pytest.approx(sum(per_token) / 8)


def test_extreme_log_ratio_is_clamped_not_inf():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.tensor([[-80.0, -1.0, -1.0]])
    lp = torch.tensor([[-1.0, -90.0, -1.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    for name in PolicyLossType:
        cfg = PolicyLossConfig(name=name, clip_ratio_c=None)
        lp.grad = None
        loss, metrics = policy_loss(lp, old, adv, mask, denominators_for(mask), cfg, "token-mean")
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), name
        if name is not PolicyLossType.GSPO:
            assert metrics["ratio_max"].value.item() == pytest.approx(math.exp(LOG_RATIO_CLAMP))
            assert metrics["ratio_min"].value.item() == pytest.approx(math.exp(-LOG_RATIO_CLAMP))


def test_all_masked_micro_batch_gives_zero_loss_and_identity_extremes():
    batch = make_batch(torch.float32)
    mask = torch.zeros_like(batch["loss_mask"])
    lp = leaf(batch["logprobs"])
    d = denominators_for(batch["loss_mask"])  # the mini-batch's, not this micro-batch's
    cfg = PolicyLossConfig(kl_coef=0.1)
    loss, metrics = policy_loss(
        lp,
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        d,
        cfg,
        "seq-mean-token-mean",
        ref_logprobs=batch["ref_logprobs"],
    )
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    assert metrics["ratio_min"].value.item() == math.inf
    assert metrics["ratio_max"].value.item() == -math.inf


# --------------------------------------------------------------------------- KL estimators


@pytest.mark.parametrize("estimator", [e.value for e in KLEstimator])
def test_kl_penalty_values_and_gradients(estimator):
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 2
    ref = lp + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.5
    lp = lp.requires_grad_(True)
    upstream = torch.rand(4, 6, generator=g, dtype=torch.float64) + 0.5
    out = kl_penalty(lp, ref, estimator)
    out.backward(upstream)
    ref_lp = lp.detach().clone().requires_grad_(True)
    expected = torch.stack(
        [
            torch.stack([ref_kl(ref_lp[b, t], ref[b, t], estimator) for t in range(6)])
            for b in range(4)
        ]
    )
    expected.backward(upstream)
    assert_close(out, expected, 1e-12, 1e-12, "kl value")
    assert_close(lp.grad, ref_lp.grad, 1e-12, 1e-12, "kl grad")
    if estimator.endswith("+"):  # straight-through: the gradient is k2's, d/dlp = log r
        assert_close(lp.grad, upstream * (lp.detach() - ref), 1e-12, 1e-12, "st grad")
    if estimator in ("k3", "k3+"):
        assert (out >= 0).all()


def test_kl_k3_is_clamped_and_masked_nan_is_harmless():
    lp = torch.tensor([[-50.0, -1.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-0.1, -1.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    out = kl_penalty(lp, ref, "k3", mask=mask)
    out.sum().backward()
    assert out[0, 0].item() == K3_MAX and out[0, 1].item() == 0.0 and out[0, 2].item() == 0.0
    assert torch.isfinite(lp.grad).all()


# --------------------------------------------------------------------------- value, SFT, entropy


@pytest.mark.parametrize("cliprange_value", [None, 0.2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,rtol,atol", DTYPES)
def test_value_loss_matches_reference(cliprange_value, mode, dtype, rtol, atol):
    batch = make_batch(dtype, seed=7)
    mask = batch["loss_mask"]
    g = torch.Generator().manual_seed(8)
    old = batch["ref_logprobs"]  # any finite-where-masked tensors will do
    values = leaf(batch["logprobs"])
    returns = (
        batch["old_logprobs"].double() + torch.randn(mask.shape, generator=g, dtype=torch.float64)
    ).to(dtype)
    loss, metrics = value_loss(
        values, old, returns, mask, denominators_for(mask), mode, cliprange_value=cliprange_value
    )
    loss.backward(torch.tensor(1.9, dtype=dtype))

    ref_values = leaf(batch["logprobs"]).double().detach().requires_grad_(True)
    per_token, clipped_count, errors = {}, 0, []
    for b, t in mask.nonzero().tolist():
        v, vo, r = ref_values[b, t], num(old[b, t]), num(returns[b, t])
        plain = (v - r) ** 2
        if cliprange_value is None:
            per_token[(b, t)] = 0.5 * plain
        else:
            vc = vo + torch.clamp(v - vo, -cliprange_value, cliprange_value)
            per_token[(b, t)] = 0.5 * torch.maximum(plain, (vc - r) ** 2)
            clipped_count += num((vc - r) ** 2) > num(plain)
        errors.append(num(plain))
    ref = ref_aggregate(per_token, mask, mode, SEQ_LEN_NORM)
    (1.9 * ref).backward()
    n = int(mask.sum())
    assert_close(loss, ref, rtol, atol, "value loss")
    assert_close(values.grad, ref_values.grad, rtol, atol, "value grad")
    assert_close(metrics["vf_loss"].value, num(ref), **METRIC_TOL, what="vf_loss")
    assert_close(metrics["vf_clipfrac"].value, clipped_count / n, **METRIC_TOL, what="vf_clipfrac")
    assert_close(metrics["vf_error"].value, sum(errors) / n, **METRIC_TOL, what="vf_error")
    expected_mean = sum(num(ref_values[b, t]) for b, t in mask.nonzero().tolist()) / n
    assert_close(metrics["vpred_mean"].value, expected_mean, **METRIC_TOL, what="vpred_mean")
    if cliprange_value is not None:
        assert 0 < clipped_count < n  # the test exercises both branches


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,rtol,atol", DTYPES)
def test_sft_and_entropy_match_reference(mode, dtype, rtol, atol):
    batch = make_batch(dtype, seed=9)
    mask = batch["loss_mask"]
    d = denominators_for(mask)
    lp, ent = leaf(batch["logprobs"]), leaf(batch["entropy"])
    loss, metrics = sft_loss(lp, mask, d, mode)
    bonus, ent_metrics = entropy_bonus(ent, mask, d, mode)
    (loss * 0.3 + bonus * 1.1).backward()

    ref_lp = batch["logprobs"].double().detach().requires_grad_(True)
    ref_ent = batch["entropy"].double().detach().requires_grad_(True)
    tokens = [tuple(x) for x in mask.nonzero().tolist()]
    ref_loss = ref_aggregate({k: -ref_lp[k] for k in tokens}, mask, mode, SEQ_LEN_NORM)
    ref_bonus = ref_aggregate({k: ref_ent[k] for k in tokens}, mask, mode, SEQ_LEN_NORM)
    (ref_loss * 0.3 + ref_bonus * 1.1).backward()
    assert_close(loss, ref_loss, rtol, atol, "sft loss")
    assert_close(bonus, ref_bonus, rtol, atol, "entropy bonus")
    assert_close(lp.grad, ref_lp.grad, rtol, atol, "sft grad")
    assert_close(ent.grad, ref_ent.grad, rtol, atol, "entropy grad")
    assert_close(metrics["sft_loss"].value, num(ref_loss), **METRIC_TOL, what="sft_loss")
    mean_ent = sum(num(ref_ent[k]) for k in tokens) / len(tokens)
    assert_close(ent_metrics["entropy"].value, mean_ent, **METRIC_TOL, what="entropy")


def test_grad_is_none_exactly_for_inputs_without_requires_grad():
    batch = make_batch(torch.float32)
    mask = batch["loss_mask"]
    lp = leaf(batch["logprobs"])
    old, adv, ref = (
        batch[k].clone().requires_grad_(True)
        for k in ("old_logprobs", "advantages", "ref_logprobs")
    )
    cfg = PolicyLossConfig(kl_coef=0.1)
    loss, _ = policy_loss(
        lp, old, adv, mask, denominators_for(mask), cfg, "token-mean", ref_logprobs=ref
    )
    loss.backward()
    assert lp.grad is not None
    # old log-probs, advantages and the reference are constants of the loss
    assert old.grad is None and adv.grad is None and ref.grad is None


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_where_the_loss_is_its_own_gradient(mode):
    """Finite differences, independent of autograd's bookkeeping, for the losses whose gradient
    is the derivative of their value (not the straight-through / stop-gradient ones)."""
    batch = make_batch(torch.float64, seed=13, batch=3, length=6)
    mask = batch["loss_mask"]
    d = denominators_for(mask)
    cfg = PolicyLossConfig(kl_coef=0.2, kl_estimator="k3", entropy_coef=0.1, clip_ratio_c=2.0)

    def policy(lp, ent):
        return policy_loss(
            lp,
            batch["old_logprobs"],
            batch["advantages"],
            mask,
            d,
            cfg,
            mode,
            ref_logprobs=batch["ref_logprobs"],
            entropy=ent,
            validate=False,
        )[0]

    def value(v):
        return value_loss(
            v,
            batch["ref_logprobs"],
            batch["old_logprobs"],
            mask,
            d,
            mode,
            cliprange_value=0.3,
            validate=False,
        )[0]

    lp, ent = leaf(batch["logprobs"]), leaf(batch["entropy"])
    assert torch.autograd.gradcheck(policy, (lp, ent), eps=1e-7, atol=1e-6)
    assert torch.autograd.gradcheck(value, (leaf(batch["logprobs"]),), eps=1e-7, atol=1e-6)
    assert torch.autograd.gradcheck(
        lambda x: sft_loss(x, mask, d, mode, validate=False)[0], (lp,), eps=1e-7, atol=1e-6
    )
