"""``policy_loss.bypass_mode``: the sampler's ``rollout_logprobs`` are the ratio's anchor
(losses/policy.py, engine/actor.py; docs/losses.md#bypass-mode-bypass_mode).

The bypass is the recomputed loss with ``old_logprobs = rollout_logprobs``, exactly; only the
``mismatch/*`` metrics differ: they compare the sampler with the current pass.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_close_dicts, grads_of, make_batch, tiny_model

from microrl.configs import ActorConfig, LoraConfig, PolicyLossConfig
from microrl.engine import ActorEngine
from microrl.losses import MISMATCH_METRICS, global_denominators, mismatch_metrics, policy_loss


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, :2] = False
    mask[3, 4:] = False
    rollout = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    logprobs = rollout + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.2
    return {
        "logprobs": logprobs.requires_grad_(),
        "rollout_logprobs": rollout,
        "advantages": torch.randn(4, 6, generator=g, dtype=torch.float64),
        "ref_logprobs": rollout + 0.1,
        "loss_mask": mask,
    }


def _loss(inputs, config, old):
    denominators = global_denominators(inputs["loss_mask"])
    return policy_loss(
        inputs["logprobs"],
        old,
        inputs["advantages"],
        inputs["loss_mask"],
        denominators,
        config,
        "token-mean",
        ref_logprobs=inputs["ref_logprobs"],
        rollout_logprobs=inputs["rollout_logprobs"],
    )


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_bypass_is_the_loss_anchored_on_the_rollout_logprobs(name: str) -> None:
    inputs = _inputs()
    loss, metrics = _loss(inputs, PolicyLossConfig(name=name, bypass_mode=True), None)
    (grad,) = torch.autograd.grad(loss, inputs["logprobs"])
    anchored, expected = _loss(inputs, PolicyLossConfig(name=name), inputs["rollout_logprobs"])
    (expected_grad,) = torch.autograd.grad(anchored, inputs["logprobs"])
    assert loss.item() == anchored.item()
    assert torch.equal(grad, expected_grad)
    assert metrics.keys() == expected.keys()
    for key in metrics.keys() - set(MISMATCH_METRICS):
        assert torch.equal(metrics[key].value, expected[key].value), key
    # The recomputed loss compares the sampler with itself here (0); the bypass compares it
    # with the current pass.
    assert expected["mismatch/abs_diff_max"].value.item() == 0.0
    mask = inputs["loss_mask"]
    current = mismatch_metrics(
        inputs["logprobs"].detach(), inputs["rollout_logprobs"], mask, global_denominators(mask)
    )
    for key in MISMATCH_METRICS:
        assert torch.equal(metrics[key].value, current[key].value), key
    assert metrics["mismatch/abs_diff_max"].value.item() > 0


def test_bypass_errors() -> None:
    inputs = _inputs()
    with pytest.raises(ValueError, match="old_logprobs must be None"):
        _loss(inputs, PolicyLossConfig(bypass_mode=True), inputs["rollout_logprobs"])
    with pytest.raises(ValueError, match="rollout_logprobs is required"):
        policy_loss(
            inputs["logprobs"],
            None,
            inputs["advantages"],
            inputs["loss_mask"],
            global_denominators(inputs["loss_mask"]),
            PolicyLossConfig(bypass_mode=True),
            "token-mean",
        )
    with pytest.raises(ValueError, match="old_logprobs is required"):
        _loss(inputs, PolicyLossConfig(), None)
    with pytest.raises(ValueError, match=r"policy_loss\.bypass_mode cannot be combined"):
        PolicyLossConfig(bypass_mode=True, tis_cap=2.0)
    with pytest.raises(ValueError, match=r"policy_loss\.bypass_mode must be a bool"):
        PolicyLossConfig(bypass_mode="yes")


def test_engine_bypass_trains_without_old_logprobs() -> None:
    """The engine needs ``rollout_logprobs`` instead of ``old_logprobs``; its step is the
    recomputed step with ``old_logprobs = rollout_logprobs``, to the bit."""
    batch = make_batch()
    batch["rollout_logprobs"] = batch["old_logprobs"]
    engines = []
    for bypass in (False, True):
        config = ActorConfig(
            micro_batch_size=2,
            lora=LoraConfig(rank=4),
            policy_loss=PolicyLossConfig(bypass_mode=bypass),
        )
        torch.manual_seed(0)
        engines.append(ActorEngine(tiny_model(), config))
    recompute, bypass = engines
    expected = recompute.forward_backward_batch(batch)
    got = bypass.forward_backward_batch(batch.exclude("old_logprobs"))
    assert got["loss"] == expected["loss"]
    assert_close_dicts(grads_of(bypass.module), grads_of(recompute.module), rtol=0, atol=0)
    for key in expected["metrics"].keys() - set(MISMATCH_METRICS):
        assert got["metrics"][key] == expected["metrics"][key], key
    assert expected["metrics"]["mismatch/abs_diff_max"] == 0.0
    assert got["metrics"]["mismatch/abs_diff_max"] > 0  # the current pass vs the random rollout
    with pytest.raises(ValueError, match="rollout_logprobs"):
        bypass.forward_backward_batch(batch.exclude("rollout_logprobs"))
