"""forward_backward_batch is a loop over the public forward_step: one call per planned micro-batch.

A second, private copy of the micro-batch body is how a loop and its documented building block
drift apart (the step tested, the loop not). Here the loop is spied on: 3 planned micro-batches
mean exactly 3 calls of ``forward_step``, each with the mini-batch's global denominators, on the
fused loss path, the kernel + loss path and a forward-only pass alike. The step hands its loss,
outputs and metrics back as its return value (a ``StepResult``), which the loop checks, as it
checks what a fused-loss ``_model_forward`` returns.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from engine_utils import make_batch, tiny_model

from microrl.configs import ActorConfig
from microrl.engine import ActorEngine
from microrl.engine.microbatch import MicroBatch, compact_rows
from microrl.engine.outputs import StepResult
from microrl.losses import Metric


def _spy(engine: ActorEngine, monkeypatch: pytest.MonkeyPatch) -> list:
    calls = []
    real = engine.forward_step

    def forward_step(micro, loss_fn=None, forward_only=False, *, denominators=None):
        calls.append((micro, denominators))
        return real(micro, loss_fn, forward_only, denominators=denominators)

    monkeypatch.setattr(engine, "forward_step", forward_step)
    return calls


@pytest.mark.parametrize("fuse_loss", [True, False], ids=["fused-loss", "kernel+loss"])
def test_three_planned_micro_batches_are_three_forward_steps(monkeypatch, fuse_loss) -> None:
    engine = ActorEngine(tiny_model(seed=0), ActorConfig(micro_batch_size=2, fuse_loss=fuse_loss))
    assert engine.fuses_loss(None) is fuse_loss
    calls = _spy(engine, monkeypatch)
    batch = make_batch(6, 12, seed=1)  # 6 rows, 2 per micro-batch
    result = engine.forward_backward_batch(batch)
    assert len(calls) == 3
    micros, denominators = zip(*calls, strict=True)
    assert all(isinstance(m, MicroBatch) and len(m.lengths) == 2 for m in micros)
    # The mini-batch's denominators, the same object for every micro-batch: counted once.
    assert denominators[0] is not None and all(d is denominators[0] for d in denominators)
    assert denominators[0].n_tokens.item() == batch["loss_mask"].sum().item()
    assert result["model_output"].batch_size == torch.Size([6])

    calls.clear()
    engine.forward_backward_batch(batch, forward_only=True)
    assert len(calls) == 3


def test_train_batch_reaches_the_loss_through_forward_step(monkeypatch) -> None:
    # The step path reads as documented: train_batch -> forward_backward_batch -> forward_step ->
    # the loss, with no second copy of the loop body in between.
    engine = ActorEngine(tiny_model(seed=0), ActorConfig(micro_batch_size=3, fuse_loss=False))
    stacks = []
    real = engine.default_loss

    def default_loss(output, micro, denominators):
        stacks.append([f.function for f in inspect.stack()])
        return real(output, micro, denominators)

    monkeypatch.setattr(engine, "default_loss", default_loss)
    engine.train_batch(make_batch(6, 12, seed=1))
    assert len(stacks) == 2
    frames = stacks[0][: stacks[0].index("train_batch") + 1]
    assert "forward_step" in frames and "_forward_compact" not in frames
    assert len(frames) <= 7, frames


def test_a_planned_micro_batch_comes_back_in_its_compact_layout() -> None:
    engine = ActorEngine(tiny_model(seed=0), ActorConfig())
    batch = make_batch(4, 12, seed=2)
    _, full, _ = engine.forward_step(batch, forward_only=True)
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert full["logprobs"].shape == (4, 12)
    # The same rows as one planned micro-batch: compact [4, max length] outputs, same values.
    starts = batch["attention_mask"].long().argmax(-1)

    compact = compact_rows(batch, range(4), starts, torch.tensor(lengths), max(lengths))
    _, out, _ = engine.forward_step(MicroBatch(compact, lengths), forward_only=True)
    assert out["logprobs"].shape == (4, max(lengths))
    for row, (start, length) in enumerate(zip(starts.tolist(), lengths, strict=True)):
        torch.testing.assert_close(
            out["logprobs"][row, :length], full["logprobs"][row, start : start + length]
        )


@pytest.mark.parametrize("fuse_loss", [True, False], ids=["fused-loss", "kernel+loss"])
def test_forward_step_returns_its_loss_and_metrics(fuse_loss) -> None:
    # A plain batch alone is its own mini-batch: the step's loss and metrics are the loop's.
    engine = ActorEngine(tiny_model(seed=0), ActorConfig(micro_batch_size=8, fuse_loss=fuse_loss))
    batch = make_batch(4, 12, seed=3)
    step = engine.forward_step(batch)
    assert isinstance(step, StepResult) and not hasattr(engine, "last_step_metrics")
    assert step.loss.dim() == 0 and step.loss.grad_fn is not None
    assert all(m.value.grad_fn is None for m in step.metrics.values())
    engine.optimizer.zero_grad(set_to_none=True)
    whole = engine.forward_backward_batch(batch)
    assert set(step.metrics) == set(whole["metrics"]) and "pg_loss" in step.metrics
    # fp32 sums of O(1) terms over 4 rows, which the loop runs sorted by length: rounding only.
    for name, metric in step.metrics.items():
        expected = whole["metrics"][name]
        assert metric.value.item() == pytest.approx(expected, rel=1e-5, abs=1e-6), name
    assert step.loss.item() == pytest.approx(whole["loss"], rel=1e-5)
    evaluated = engine.forward_step(batch, forward_only=True)  # the loss keys are present
    assert evaluated.loss.grad_fn is None and "pg_loss" in evaluated.metrics
    del batch["advantages"]
    without_loss = engine.forward_step(batch, forward_only=True)
    assert without_loss.loss is None and without_loss.metrics == {}


class _Overridden(ActorEngine):
    """A user's ``forward_step`` override: one more metric, reported by return value."""

    def forward_step(self, micro_batch, loss_fn=None, forward_only=False, *, denominators=None):
        loss, output, metrics = super().forward_step(
            micro_batch, loss_fn, forward_only, denominators=denominators
        )
        rows = torch.tensor(float(output.batch_size[0]))
        return StepResult(loss, output, {**metrics, "rows": Metric(rows)})


def test_an_override_reports_its_metrics_by_return_value() -> None:
    engine = _Overridden(tiny_model(seed=0), ActorConfig(micro_batch_size=2))
    result = engine.forward_backward_batch(make_batch(6, 12, seed=1))
    assert result["metrics"]["rows"] == 6.0  # SUM over the 3 micro-batches of 2 rows


@pytest.mark.parametrize(
    "returned, message",
    [
        (lambda step: step[:2], r"must return StepResult\(loss, output, metrics\).*tuple of 2"),
        (lambda step: step.output, r"must return StepResult.*got a TensorDict"),
        (lambda step: (step.loss, dict(step.output.items()), {}), "output must be a TensorDict"),
        (
            lambda step: (step.loss, step.output, {"x": 1.0}),
            r"metrics must be a dict\[str, Metric\]",
        ),
        (lambda step: (step.loss.reshape(1), step.output, {}), "loss must be a 0-d tensor or None"),
    ],
    ids=["old-pair", "output-only", "dict-output", "float-metric", "1-d-loss"],
)
def test_an_override_returning_the_wrong_value_is_a_type_error(returned, message) -> None:
    class Wrong(ActorEngine):
        def forward_step(self, *args, **kwargs):
            return returned(super().forward_step(*args, **kwargs))

    engine = Wrong(tiny_model(seed=0), ActorConfig(micro_batch_size=2))
    with pytest.raises(TypeError, match=rf"Wrong\.forward_step.*{message}"):
        engine.forward_backward_batch(make_batch(4, 12, seed=1))


def test_a_fused_loss_role_returns_its_loss_among_its_outputs() -> None:
    # On the fused loss path the loss travels back from _model_forward as a return value too:
    # a role that drops it is named, instead of training on a loss that never arrived.
    class Dropping(ActorEngine):
        def _model_forward(self, *args, **kwargs):
            out = super()._model_forward(*args, **kwargs)
            return {key: value for key, value in out.items() if key != "loss"}

    engine = Dropping(tiny_model(seed=0), ActorConfig(micro_batch_size=2))
    assert engine.fuses_loss(None)
    with pytest.raises(TypeError, match=r"Dropping\._model_forward got a group_loss.*'loss'"):
        engine.forward_backward_batch(make_batch(4, 12, seed=1))
    engine.forward_backward_batch(make_batch(4, 12, seed=1), forward_only=True)  # no loss: fine
