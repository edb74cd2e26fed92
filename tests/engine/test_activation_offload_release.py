"""Activation offload releases each host copy when the backward is done with it, not later.

An :class:`~microrl.engine.offload.ActivationOffload` block is kept alive by a reference cycle
(its pack and unpack hooks are bound methods of it), so whatever it references lives until
Python's cycle collector runs. Its forward-time table of copies (``_copied``) must therefore be
dropped when the block exits: otherwise every host copy (and on CUDA the device tensor each was
unpacked into) stays alive until the collector runs, past the end of the backward, and the copies
brought back in backward accumulate instead of being freed node by node.
``benchmarks/bench_long.py`` measures what this means for a micro-batch's peak.

With the cycle collector off, every host copy made in a training pass must be gone when
``forward_backward_batch`` returns.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from engine_utils import make_batch, tiny_model

import microrl.engine.offload as offload
from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.engine import ActorEngine
from microrl.engine.offload import ActivationOffload


@pytest.fixture
def no_cycle_collector():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@pytest.mark.usefixtures("no_cycle_collector")
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
def test_host_copies_are_freed_by_the_backward_without_the_cycle_collector(monkeypatch, ckpt):
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)  # the tiny model's tensors qualify
    copies: list[weakref.ref] = []
    real = ActivationOffload._pack

    def spy(self, tensor):
        packed = real(self, tensor)
        if isinstance(packed, offload._Offloaded):
            copies.append(weakref.ref(packed.host))
        return packed

    monkeypatch.setattr(ActivationOffload, "_pack", spy)
    config = ActorConfig(
        micro_batch_size=3,
        gradient_checkpointing=ckpt,
        activation_offload=True,
        lora=LoraConfig(rank=4, alpha=8.0),
        optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None),
    )
    engine = ActorEngine(tiny_model(), config)
    engine.forward_backward_batch(make_batch(6, 12, seed=3))
    assert len(copies) > engine.last_offload_stats.tensors > 0  # 2 micro-batches
    alive = sum(ref() is not None for ref in copies)
    assert alive == 0, f"{alive} of {len(copies)} host copies outlived the backward"
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in engine.module.parameters())


def test_no_pinned_host_memory_is_kept_after_the_updates(monkeypatch):
    """On a (simulated) GPU the host copies are pinned, and torch's host allocator keeps every
    freed pinned block cached, pinned, for a later request of its power-of-two size: it never
    returned them, so after training the copies of the largest micro-batches stayed pinned
    through sampling and the rest of the run. ``release_host_memory`` (the recipes call it once
    a step's updates are done) releases them: nothing stays pinned (no FSDP2 offload here),
    whatever the shapes were; between optimizer steps the cache is reused."""
    from device_utils import simulated_cuda

    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)  # the tiny model's tensors qualify
    with simulated_cuda(monkeypatch) as sim:
        pinned = []
        pin = sim.pinned.pin

        def counting(tensor):
            pin(tensor)
            pinned.append(sim.pinned.held)

        monkeypatch.setattr(sim.pinned, "pin", counting)
        config = ActorConfig(
            micro_batch_size=2,
            activation_offload=True,
            lora=LoraConfig(rank=4, alpha=8.0),
            optim=OptimConfig(name="sgd", lr=0.1),
        )
        engine = ActorEngine(tiny_model(), config)
        assert engine.device.type == "cuda"
        for step, length in enumerate((12, 20, 9)):  # micro-batches of several shapes
            engine.train_batch(make_batch(4, length, seed=step).to(engine.device))
            assert pinned, "nothing was offloaded to pinned memory"
            assert sim.pinned.held > 0, "the cache is for the next optimizer step"
            engine.release_host_memory()
            assert sim.pinned.held == 0, f"step {step}: {sim.pinned.held} pinned bytes kept"
