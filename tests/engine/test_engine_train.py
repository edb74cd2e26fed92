"""Training steps: on-policy first step, bad input, non-finite steps, audit, schedule, new roles."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from engine_utils import grads_of, make_batch, tiny_model
from tensordict import TensorDict
from torch import nn

from microrl.configs import ActorConfig, CriticConfig, OptimConfig, PolicyLossConfig
from microrl.engine import ActorEngine, CriticEngine, Engine
from microrl.losses import Metric

# The first on-policy step's ratio exp(logp - old_logp) is 1 up to the log-probs' run-to-run
# difference: a row's logits come from GEMMs whose blocking depends on the micro-batch's row count
# and the thread count, so the same row's fp32 log-prob differs by ~1e-7..1e-6 between micro-
# batchings (measured 4.8e-7 with 2 threads). 1e-5 is 10x that; clipping (eps = 0.2) and the
# KL estimators stay exactly 0 / untriggered at such ratios.
RATIO_TOL = 1e-5


@pytest.mark.usefixtures("intra_op_threads")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    ("infer_split", "train_split"),
    [((1, None), (None, 30)), ((None, 13), (2, None)), ((6, None), (None, 7))],
)
def test_first_on_policy_step_has_ratio_one(
    infer_split, train_split, packed: bool, fused: bool
) -> None:
    """Old log-probs from one micro-batching, the training pass in another: every ratio is 1
    within fp32 GEMM rounding (not bitwise: BLAS blocking depends on the row and thread count),
    nothing is clipped, and the KL to an identical reference is ~0."""

    def engine(split):
        config = ActorConfig(
            micro_batch_size=split[0],
            max_tokens_per_micro_batch=split[1],
            pack_sequences=packed,
            use_fused_kernel=fused,
            policy_loss=PolicyLossConfig(kl_coef=0.1),
        )
        return ActorEngine(tiny_model(seed=3), config)

    batch = make_batch(6, 12, padding="mixed", seed=21)
    batch["old_logprobs"] = engine(infer_split).infer_batch(batch)["logprobs"]
    batch["ref_logprobs"] = batch["old_logprobs"].clone()
    metrics = engine(train_split).forward_backward_batch(batch)["metrics"]
    assert abs(metrics["ratio_min"] - 1.0) <= RATIO_TOL, metrics["ratio_min"]
    assert abs(metrics["ratio_max"] - 1.0) <= RATIO_TOL, metrics["ratio_max"]
    assert metrics["pg_clipfrac"] == 0.0  # a count: exact
    assert abs(metrics["ppo_kl"]) <= RATIO_TOL and abs(metrics["kl"]) <= RATIO_TOL


def test_train_batch_steps_and_reports() -> None:
    optim = OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", total_steps=4, min_lr_ratio=0.1)
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=3, optim=optim))
    batch = make_batch(6, 10, seed=22)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    lrs = []
    for _ in range(5):
        batch["old_logprobs"] = engine.infer_batch(batch)[
            "logprobs"
        ]  # on-policy: never all clipped
        metrics = engine.train_batch(batch)
        assert {"loss", "grad_norm", "step_skipped", "lr", "pg_loss"} <= metrics.keys()
        assert all(isinstance(v, float) for v in metrics.values())
        assert metrics["step_skipped"] == 0.0 and metrics["grad_norm"] > 0
        lrs.append(metrics["lr"])
    assert engine.global_step == 5
    # warmup 1/2, 2/2 of lr, then cosine from 1 to min_lr_ratio over 2 steps, then flat.
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 0.55e-2, 1e-3])
    moved = [n for n, p in engine.module.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    assert all(p.grad is None for p in engine.module.parameters()), "grads not zeroed"


def test_grad_clip_bounds_the_update_to_the_global_norm() -> None:
    """SGD with lr=1: the update is minus the clipped gradient, so its global norm is grad_clip
    while the reported grad_norm is the norm before clipping."""
    clip = 1e-3
    optim = OptimConfig(name="sgd", lr=1.0, grad_clip=clip)
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2, optim=optim))
    batch = make_batch(4, 10, seed=31)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    metrics = engine.train_batch(batch)
    delta = torch.cat(
        [(p.detach() - before[n]).flatten() for n, p in engine.module.named_parameters()]
    )
    assert metrics["grad_norm"] > 10 * clip  # clipping must bind for the check to mean anything
    assert delta.norm().item() == pytest.approx(clip, rel=1e-4)


def test_sft_loss_trains_with_the_engine() -> None:
    engine = ActorEngine(
        tiny_model(), ActorConfig(micro_batch_size=4, optim=OptimConfig(lr=3e-3, grad_clip=None))
    )
    batch = make_batch(4, 10, seed=23).select("input_ids", "attention_mask", "loss_mask")
    first = engine.train_batch(batch, loss_fn=engine.sft_loss)
    for _ in range(10):
        last = engine.train_batch(batch, loss_fn=engine.sft_loss)
    assert last["sft_loss"] < first["sft_loss"] - 0.1
    assert first["loss"] == pytest.approx(first["sft_loss"], rel=1e-6)


def test_non_finite_gradient_skips_the_step_untouched() -> None:
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2))
    batch = make_batch(4, 10, seed=24)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    engine.train_batch(batch)  # a real step first, so AdamW has state to protect
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in engine.optimizer.state.items()}
    step, lr = engine.global_step, engine.lr_scheduler.get_last_lr()

    def nan_loss(output, micro_batch, denominators):
        lp = output["logprobs"]
        return (lp * float("nan")).sum(), {}

    metrics = engine.train_batch(batch, loss_fn=nan_loss)
    assert metrics["step_skipped"] == 1.0 and not torch.isfinite(torch.tensor(metrics["grad_norm"]))
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, params[name]), name
        assert p.grad is None
    for p, s in engine.optimizer.state.items():
        for key, value in s.items():
            assert torch.equal(value, state[id(p)][key])
    assert engine.global_step == step and engine.lr_scheduler.get_last_lr() == lr


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_all_masked_batch_gives_zero_loss_and_gradients(role: str) -> None:
    if role == "actor":
        engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2, check_grad_flow="error"))
    else:
        engine = CriticEngine(
            tiny_model(), CriticConfig(micro_batch_size=2, check_grad_flow="error")
        )
    batch = make_batch(4, 10, seed=25)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    result = engine.forward_backward_batch(batch)  # no audit error: no loss token at all
    assert result["loss"] == 0.0
    extremes = {k for k in result["metrics"] if k.endswith(("_min", "_max"))}
    # Sums and means over no token are 0; a min/max over an empty set has no value: NaN.
    assert all(math.isfinite(v) for k, v in result["metrics"].items() if k not in extremes)
    assert all(math.isnan(result["metrics"][k]) for k in extremes)
    assert all(g.abs().max() == 0 for g in grads_of(engine.module).values())


class FrozenBodyReward(Engine):
    """A user-defined role (a scalar reward per token) that overrides head and loss only.

    Its head deliberately detaches the body's hidden states: the silent "backbone frozen while
    the head trains" bug the grad-flow audit exists to catch.
    """

    loss_keys = ("loss_mask", "returns")

    def _build_module(self, causal_lm):
        class Head(nn.Module):
            def __init__(self, body):
                super().__init__()
                self.body = body
                self.score = nn.Linear(body.config.hidden_size, 1)

            def forward(self, input_ids, position_ids, attention_mask):
                hidden = self.body(
                    input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask
                ).last_hidden_state
                return self.score(hidden.detach()).squeeze(-1)

        return Head(causal_lm.get_decoder())

    def _model_forward(self, input_ids, position_ids, attention_mask, targets, *, training, **kw):
        return {"reward": self.module(input_ids, position_ids, attention_mask)}

    def default_loss(self, output, micro_batch, denominators):
        mask = micro_batch["loss_mask"]
        err = torch.where(mask, (output["reward"] - micro_batch["returns"]) ** 2, 0.0)
        loss = err.sum() / denominators.n_tokens
        return loss, {"mse": Metric(loss.detach())}


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_grad_flow_audit_catches_a_frozen_backbone(mode: str, caplog) -> None:
    engine = FrozenBodyReward(tiny_model(), CriticConfig(micro_batch_size=2, check_grad_flow=mode))
    batch = make_batch(4, 10, seed=26)
    if mode == "error":
        with pytest.raises(RuntimeError, match=r"without gradient.*layers"):
            engine.forward_backward_batch(batch)
        return
    with caplog.at_level(logging.WARNING):
        result = engine.forward_backward_batch(batch)
    assert "grad-flow audit" in caplog.text and "embed_tokens" in caplog.text
    assert "score" not in caplog.text.split("grad-flow audit")[1]
    assert result["model_output"]["reward"].shape == (4, 10)
    assert "mse" in result["metrics"]


def _engine() -> ActorEngine:
    return ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.exclude("advantages"), "missing required key"),
        (lambda b: b.set("input_ids", b["input_ids"] + 1000), "outside the vocabulary"),
        (lambda b: b.set("input_ids", b["input_ids"].int()), "int64"),
        (lambda b: b[:0], "non-empty"),
        (
            lambda b: TensorDict(
                {k: (v[:, :-1] if k == "loss_mask" else v) for k, v in b.items()}, batch_size=[4]
            ),
            "'loss_mask' must have the shape",
        ),
        (
            lambda b: b.set("attention_mask", torch.zeros_like(b["attention_mask"])),
            "without any real",
        ),
        (
            lambda b: b.set("attention_mask", torch.tensor([[1, 0, 1] + [1] * 7] * 4).bool()),
            "contiguous",
        ),
        (lambda b: b.set("loss_mask", b["attention_mask"].clone()), "no prediction"),
        (
            lambda b: b.set("old_logprobs", torch.full_like(b["old_logprobs"], float("nan"))),
            "not finite",
        ),
        (lambda b: b.set("advantages", b["advantages"].long()), "floating-point"),
        (
            lambda b: b.set("rollout_logprobs", torch.full_like(b["old_logprobs"], float("nan"))),
            "'rollout_logprobs' is not finite",
        ),
        (lambda b: b.set("position_ids", torch.zeros_like(b["input_ids"])), "position_ids"),
    ],
)
def test_bad_batches_are_rejected_before_compute(mutate, message) -> None:
    engine = _engine()
    batch = mutate(make_batch(4, 10, seed=27))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with pytest.raises(ValueError, match=message):
        engine.forward_backward_batch(batch)
    assert all(p.grad is None for p in engine.module.parameters())
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())


def test_mis_shaped_loss_mask_is_named_in_a_forward_only_pass() -> None:
    batch = make_batch(4, 10, seed=27)
    bad = TensorDict(
        {k: (v[:, :-1] if k == "loss_mask" else v) for k, v in batch.items()}, batch_size=[4]
    )
    with pytest.raises(ValueError, match="'loss_mask' must have the shape"):
        _engine().forward_backward_batch(bad, forward_only=True)


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (lambda out, mb, d: out["logprobs"].sum(), r"return \(loss, metrics\)"),
        (lambda out, mb, d: (out["logprobs"], {}), "0-d tensor"),
        (lambda out, mb, d: (out["logprobs"].sum(), {"x": 1.0}), "Metric"),
    ],
    ids=["not-a-pair", "not-0-d", "raw-metric"],
)
def test_malformed_custom_loss_results_are_named(loss_fn, message) -> None:
    batch = make_batch(4, 10, seed=32)
    with pytest.raises(TypeError, match=message):
        _engine().forward_backward_batch(batch, loss_fn=loss_fn)


def test_custom_loss_metrics_are_detached() -> None:
    """A custom loss that forgets ``.detach()`` on a metric must not keep its graph alive."""

    def loss_fn(output, micro_batch, denominators):
        loss = -(output["logprobs"] * micro_batch["loss_mask"]).sum() / denominators.n_tokens
        return loss, {"nll": Metric(loss)}  # not detached

    engine = _engine()
    batch = make_batch(4, 10, seed=33)
    loss, _, metrics = engine.forward_step(batch, loss_fn=loss_fn)
    assert loss.grad_fn is not None
    assert metrics["nll"].value.grad_fn is None
    assert metrics["nll"].value.item() == pytest.approx(loss.item())


def test_bad_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="not both"):
        ActorConfig(micro_batch_size=2, max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="check_grad_flow"):
        ActorConfig(check_grad_flow="loud")
    with pytest.raises(TypeError, match="ActorConfig"):
        ActorEngine(tiny_model(), CriticConfig())
    with pytest.raises(ValueError, match="not a local checkpoint"):
        ActorEngine("/nonexistent/model", ActorConfig())


def test_forward_only_without_loss_inputs_returns_outputs_only() -> None:
    engine = _engine()
    batch = make_batch(4, 10, seed=28).select("input_ids", "attention_mask")
    result = engine.forward_backward_batch(batch, forward_only=True)
    assert result["loss"] == 0.0 and result["metrics"] == {}
    assert set(result["model_output"].keys()) == {"logprobs", "entropy"}
    assert all(p.grad is None for p in engine.module.parameters())


def test_checkpoint_round_trip(tmp_path) -> None:
    engine = _engine()
    batch = make_batch(4, 10, seed=29)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    engine.train_batch(batch)
    engine.save_checkpoint(tmp_path / "ckpt")
    expected = engine.train_batch(batch)
    restored = _engine()
    restored.load_checkpoint(tmp_path / "ckpt")
    assert restored.global_step == 1
    assert restored.train_batch(batch) == pytest.approx(expected, rel=1e-5)


def test_the_callers_batch_is_not_modified() -> None:
    engine = _engine()
    batch = make_batch(4, 10, seed=30)
    batch["attention_mask"] = batch["attention_mask"].long()
    before = batch.clone()
    engine.forward_backward_batch(batch)
    engine.infer_batch(batch.exclude("attention_mask"))
    assert set(batch.keys()) == set(before.keys())
    assert all(
        torch.equal(batch[k], before[k]) and batch[k].dtype == before[k].dtype
        for k in list(before.keys())
    )
