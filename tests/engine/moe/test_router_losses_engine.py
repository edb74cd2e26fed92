"""The router losses through the engine (docs/losses.md#router-losses): the load-balancing loss
is the model's own function over the whole mini-batch, whatever the micro-batches, packing or
role; a per-micro-batch variant of it fails the same check; the router logits die with their
micro-batch. The 2-rank comparison is in tests/engine/parallel/test_moe_distributed.py."""

from __future__ import annotations

import weakref

import pytest
import torch
from engine_utils import assert_close_dicts, grads_of, make_batch
from moe_utils import aux_loss_reference, router_modules, tiny_moe

from microrl.configs import ActorConfig, CriticConfig, OptimConfig
from microrl.engine import ActorEngine, CriticEngine
from microrl.losses import RouterLossConfig
from microrl.losses import router as router_losses
from microrl.losses.router import RouterDenominators, expert_counts

SGD = OptimConfig(name="sgd", lr=1.0, grad_clip=None)
COEF = 0.5
# float64 models, but transformers' load_balancing_loss_func sums the probabilities in float32
# (and Qwen3-MoE's router takes its softmax in float32): the reference is float32-exact.
ATOL = 1e-6
SPLITS = {
    "mbs1": {"micro_batch_size": 1},
    "mbs2": {"micro_batch_size": 2},
    "whole": {"micro_batch_size": 6},
    "packed": {"max_tokens_per_micro_batch": 24, "pack_sequences": True},
}


def _no_policy_loss(output, micro_batch, denominators):
    """A zero loss with the graph: the gradients are the router losses' alone."""
    return (output["logprobs"] * 0).sum(), {}


def _batch():
    return make_batch(6, 12, padding="mixed", seed=4, dtype=torch.float64)


def _engine_grads(family: str, split: dict, batch):
    config = ActorConfig(**split, router_loss=RouterLossConfig(aux_loss_coef=COEF), optim=SGD)
    engine = ActorEngine(tiny_moe(family, dtype=torch.float64), config)
    result = engine.forward_backward_batch(batch, loss_fn=_no_policy_loss)
    return result, grads_of(engine.module)


@pytest.mark.parametrize(
    ("family", "split"),
    [("qwen3_moe", "mbs1"), ("qwen3_moe", "mbs2"), ("qwen3_moe", "whole"), ("gpt_oss", "packed")],
)
def test_aux_loss_gradients_are_the_models_own_for_any_split(family, split):
    batch = _batch()
    value, expected = aux_loss_reference(family, batch, COEF)
    result, grads = _engine_grads(family, SPLITS[split], batch)
    assert result["metrics"]["router/aux_loss"] == pytest.approx(value, rel=1e-6)
    assert result["loss"] == pytest.approx(COEF * value, rel=1e-6)
    assert_close_dicts(grads, expected, rtol=0, atol=ATOL)


def _per_micro_batch(logits, valid, denominators):
    """The bug the contract forbids: each micro-batch's own load fractions and row count."""
    counts = sum(expert_counts(x.detach().topk(2).indices, valid, 4) for x in logits)
    rows = valid.sum().double() * len(logits)
    own = RouterDenominators(rows, counts / rows.clamp_min(1))
    return _exact(logits, valid, own) * rows / denominators.n_rows


_exact = router_losses.load_balancing_partial


def test_a_per_micro_batch_aux_loss_fails_the_check(monkeypatch):
    batch = _batch()
    _, expected = aux_loss_reference("qwen3_moe", batch, COEF)
    monkeypatch.setattr(router_losses, "load_balancing_partial", _per_micro_batch)
    _, grads = _engine_grads("qwen3_moe", SPLITS["mbs2"], batch)
    worst = max((grads[k] - expected[k]).abs().max().item() for k in expected)
    assert worst > 100 * ATOL, worst


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_policy_and_router_losses_together_are_the_same_for_any_split(role):
    """The default loss plus both router terms: gradients, loss and metrics of 1, 2 and all rows
    per micro-batch agree to float64 rounding (the same compact rows, other groupings)."""
    batch = _batch()
    coefs = RouterLossConfig(aux_loss_coef=0.3, z_loss_coef=0.01)
    results = []
    for split in ("mbs1", "mbs2", "whole"):
        if role == "actor":
            config = ActorConfig(**SPLITS[split], router_loss=coefs, optim=SGD)
            engine = ActorEngine(tiny_moe("gpt_oss", dtype=torch.float64), config)
        else:
            config = CriticConfig(**SPLITS[split], router_loss=coefs, optim=SGD)
            engine = CriticEngine(tiny_moe("gpt_oss", dtype=torch.float64), config)
        result = engine.forward_backward_batch(batch)
        results.append((result["loss"], result["metrics"], grads_of(engine.module)))
    loss, metrics, grads = results[0]
    assert {"router/aux_loss", "router/z_loss", "router/layer1/load_min"} <= metrics.keys()
    for other_loss, other_metrics, other_grads in results[1:]:
        assert other_loss == pytest.approx(loss, rel=1e-9)
        assert_close_dicts(other_metrics, metrics, rtol=1e-6, atol=1e-9)
        assert_close_dicts(other_grads, grads, rtol=0, atol=1e-9)


def test_router_logits_die_with_their_micro_batch():
    """Each training forward's router logits (with their graph, for the router losses) are freed
    by the time the next micro-batch's forward starts: nothing keeps them across micro-batches."""
    engine = ActorEngine(
        tiny_moe("qwen3_moe"),
        ActorConfig(
            micro_batch_size=1,
            router_loss=RouterLossConfig(aux_loss_coef=0.1, z_loss_coef=0.01),
            optim=SGD,
        ),
    )
    logits, alive = [], []

    def watch(module, args, output):
        if torch.is_grad_enabled():  # a training forward, not the counting pass
            alive.append(sum(ref() is not None for ref in logits))
            logits.append(weakref.ref(output[0]))

    router_modules(engine.module)[0].register_forward_hook(watch)
    engine.train_batch(make_batch(3, 8, seed=1))
    assert alive == [0, 0, 0]
    assert all(ref() is None for ref in logits)


def test_a_direct_forward_step_adds_the_router_losses_of_its_rows():
    """``forward_step`` on a plain batch treats its rows as a whole mini-batch: its loss carries
    the aux loss of those rows, the model's own (the counting pass runs inside the call)."""
    batch = _batch()
    value, expected = aux_loss_reference("qwen3_moe", batch, COEF)
    config = ActorConfig(router_loss=RouterLossConfig(aux_loss_coef=COEF), optim=SGD)
    engine = ActorEngine(tiny_moe("qwen3_moe", dtype=torch.float64), config)
    step = engine.forward_step(batch, loss_fn=_no_policy_loss)
    assert float(step.metrics["router/aux_loss"].value) == pytest.approx(value, rel=1e-6)
    step.loss.backward()
    assert_close_dicts(grads_of(engine.module), expected, rtol=0, atol=ATOL)
