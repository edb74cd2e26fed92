"""Shared by the ``hf`` worker and pool tests: a tiny LoRA engine, its update, the same-rollout check."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.run import ModelConfig
from microrl.engine import ActorEngine
from microrl.losses import broadcast_to_tokens
from microrl.rollout import HFRollout, SamplingParams
from microrl.rollout.worker.stream import as_bytes
from microrl.run.toy_model import build_model, build_tokenizer
from microrl.tasks import HintedAdditionTask

PROMPTS = ["1+2=", "34+5=", "7+8="]


SEEDED = SamplingParams(num_samples=3, max_new_tokens=4, seed=11)


def make_engine(lora_rank: int = 4, hidden_size: int = 32) -> tuple[ActorEngine, object]:
    torch.manual_seed(0)
    tok = build_tokenizer()
    shape = ModelConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_layers=2, num_heads=2
    )
    model = build_model(shape, tok)
    config = ActorConfig(
        lora=LoraConfig(rank=lora_rank), micro_batch_size=16, optim=OptimConfig(lr=5e-2)
    )
    return ActorEngine(model, config), tok


def update(engine: ActorEngine, tok) -> None:
    """One optimizer step on a rollout with random advantages: every trained tensor moves."""
    rollout = HFRollout(engine, tok).generate(PROMPTS * 2, SamplingParams(num_samples=4))
    batch = rollout.batch
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    advantages = torch.randn(batch.batch_size[0], generator=torch.Generator().manual_seed(1))
    batch["advantages"] = broadcast_to_tokens(advantages, batch["loss_mask"])
    engine.train_batch(batch)


def assert_same(rollout, reference) -> None:
    assert torch.equal(rollout.batch["input_ids"], reference.batch["input_ids"])
    assert torch.equal(rollout.batch["loss_mask"], reference.batch["loss_mask"])
    torch.testing.assert_close(
        rollout.batch["rollout_logprobs"], reference.batch["rollout_logprobs"], rtol=0, atol=1e-5
    )
    assert rollout.texts == reference.texts


def benchmark_module(name: str):
    """A module of benchmarks/ (not a package), loaded from its file."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stale_bytes(worker, buffer: torch.Tensor, name: str, before: torch.Tensor) -> torch.Tensor:
    """A copy of ``worker``'s packed trainable push ``buffer`` whose bytes of tensor ``name``
    are ``before``'s: a push that "forgets" that tensor."""
    buffer, offset = buffer.clone(), 0
    for entry, shape, dtype in worker._layouts["trainable"]:
        size = math.prod(shape) * dtype.itemsize
        if entry == name:
            buffer[offset : offset + size] = as_bytes(before)
        offset += size
    return buffer


def picky_env(problem):
    """A picklable environment factory (by reference): hinted addition, but not for 9+..."""
    if problem.prompt.startswith("9+"):
        raise RuntimeError(f"no environment for {problem.prompt}")
    return HintedAdditionTask(9, 8).make_env(problem)
