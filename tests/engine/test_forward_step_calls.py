"""forward_backward_batch is a loop over the public forward_step: one call per planned micro-batch.

A second, private copy of the micro-batch body is how a loop and its documented building block
drift apart (the step tested, the loop not). Here the loop is spied on: 3 planned micro-batches
mean exactly 3 calls of ``forward_step``, each with the mini-batch's global denominators, on the
fused loss path, the kernel + loss path and a forward-only pass alike.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from engine_utils import make_batch, tiny_model

from microrl.configs import ActorConfig
from microrl.engine import ActorEngine
from microrl.engine.microbatch import MicroBatch, compact_rows


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
    _, full = engine.forward_step(batch, forward_only=True)
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert full["logprobs"].shape == (4, 12)
    # The same rows as one planned micro-batch: compact [4, max length] outputs, same values.
    starts = batch["attention_mask"].long().argmax(-1)

    compact = compact_rows(batch, range(4), starts, torch.tensor(lengths), max(lengths))
    _, out = engine.forward_step(MicroBatch(compact, lengths), forward_only=True)
    assert out["logprobs"].shape == (4, max(lengths))
    for row, (start, length) in enumerate(zip(starts.tolist(), lengths, strict=True)):
        torch.testing.assert_close(
            out["logprobs"][row, :length], full["logprobs"][row, start : start + length]
        )
