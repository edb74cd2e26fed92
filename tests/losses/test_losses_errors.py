"""Bad input to the losses: ValueError/TypeError naming the argument, at the public boundary;
non-finite values at unmasked positions rejected (unless ``validate=False``)."""

from __future__ import annotations

import pytest
import torch
from loss_utils import denominators_for, make_batch

from microrl.losses import (
    PolicyLossConfig,
    entropy_bonus,
    global_denominators,
    kl_penalty,
    policy_loss,
    sft_loss,
    value_loss,
)


def _args(dtype=torch.float32):
    b = make_batch(dtype)
    return b, denominators_for(b["loss_mask"])


def test_bad_inputs_raise_value_errors_naming_the_argument():
    b, d = _args()
    mask, cfg = b["loss_mask"], PolicyLossConfig()
    lp, old, adv = b["logprobs"], b["old_logprobs"], b["advantages"]

    def call(**over):
        kw = dict(
            logprobs=lp,
            old_logprobs=old,
            advantages=adv,
            loss_mask=mask,
            denominators=d,
            config=cfg,
            agg_mode="token-mean",
        )
        kw.update(over)
        return policy_loss(**kw)

    cases = {
        "old_logprobs": dict(old_logprobs=old[:, :-1]),
        "advantages": dict(advantages=adv.double()),
        "logprobs": dict(logprobs=lp.long()),
        "loss_mask": dict(loss_mask=mask[0]),
        "ref_logprobs": dict(config=PolicyLossConfig(kl_coef=0.1)),
        "entropy": dict(config=PolicyLossConfig(entropy_coef=0.1)),
        "rollout_logprobs": dict(config=PolicyLossConfig(tis_cap=2.0)),
        "loss_agg_mode": dict(agg_mode="token_mean"),
        "seq_len_norm": dict(
            agg_mode="seq-mean-token-sum-norm", denominators=global_denominators(mask)
        ),
    }
    for name, over in cases.items():
        with pytest.raises(ValueError, match=name):
            call(**over)
    with pytest.raises(TypeError, match="denominators"):
        call(denominators=torch.tensor(3.0))
    with pytest.raises(TypeError, match="config"):
        call(config={"name": "ppo"})
    for field, value in [
        ("clip_ratio_low", 0.0),
        ("clip_ratio_high", -0.1),
        ("clip_ratio_c", 1.0),
        ("name", "ppo2"),
        ("kl_estimator", "k4"),
        ("tis_cap", 0.0),
    ]:
        with pytest.raises(ValueError, match=field):
            PolicyLossConfig(**{field: value})
    mutated = PolicyLossConfig()
    mutated.clip_ratio_high = 0.0  # a mutated config is re-validated at the call
    with pytest.raises(ValueError, match="clip_ratio_high"):
        call(config=mutated)
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(lp, old, adv, mask, d, "token-mean", cliprange_value=0.0)
    with pytest.raises(ValueError, match="kl estimator"):
        kl_penalty(lp, old, "k5")
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(lp, old[:, :1], "k1")


@pytest.mark.parametrize(
    "argument",
    ["logprobs", "old_logprobs", "advantages", "ref_logprobs", "entropy", "rollout_logprobs"],
)
def test_non_finite_at_unmasked_position_is_an_error_unless_validate_false(argument):
    b, d = _args()
    mask = b["loss_mask"]
    b[argument] = b[argument].clone()
    b[argument][0, 4] = float("nan")  # row 0 is unmasked at t = 2..10
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.1, tis_cap=2.0)
    kw = dict(
        ref_logprobs=b["ref_logprobs"], entropy=b["entropy"], rollout_logprobs=b["rollout_logprobs"]
    )
    with pytest.raises(ValueError, match=rf"{argument} has 1 non-finite.*\[0, 4\]"):
        policy_loss(
            b["logprobs"], b["old_logprobs"], b["advantages"], mask, d, cfg, "token-mean", **kw
        )
    loss, _ = policy_loss(
        b["logprobs"],
        b["old_logprobs"],
        b["advantages"],
        mask,
        d,
        cfg,
        "token-mean",
        validate=False,
        **kw,
    )
    assert not torch.isfinite(loss)  # the check is skipped, and nothing hides the bad value


def test_value_and_sft_reject_non_finite_and_mismatches():
    b, d = _args()
    mask = b["loss_mask"]
    bad = b["advantages"].clone()
    bad[2, 6] = float("inf")
    with pytest.raises(ValueError, match="returns"):
        value_loss(
            b["logprobs"], b["old_logprobs"], bad, mask, d, "token-mean", cliprange_value=None
        )
    with pytest.raises(ValueError, match="logprobs"):
        sft_loss(bad, mask, d, "token-mean")
    with pytest.raises(ValueError, match="old_values"):
        value_loss(
            b["logprobs"],
            b["old_logprobs"].double(),
            bad,
            mask,
            d,
            "token-mean",
            cliprange_value=None,
        )
    with pytest.raises(ValueError, match="entropy"):
        entropy_bonus(bad, mask, d, "token-mean")
