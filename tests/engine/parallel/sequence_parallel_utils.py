"""What the sequence-parallel tests share (test_sequence_parallel.py and its flash variant): the
mini-batch lengths, a Llama with one key/value head, engines with ``sequence_parallel_size``, the
per-step record of a run and its comparison with the TP tests' tolerances."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from distributed_utils import VOCAB, assert_metrics_close, full_params, full_tensor
from transformers import LlamaConfig, LlamaForCausalLM

# Micro-batches of 2 rows: widths 12, 9, 5 (odd: padded to a multiple of 2) and the one-token
# row alone (width 1 < sequence_parallel_size).
SP_LENGTHS = (12, 5, 9, 1, 7, 10, 4)
STEPS = 2  # optimizer steps per compared run


def llama_mqa(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with one key/value head for 4 query heads (replicated to 2: one per
    rank)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def build_engine(role: str, build, config, sp: int = 1):
    """A ``role`` engine (actor, critic, reward) on ``build()``, ``sequence_parallel_size=sp``."""
    from microrl.engine import ActorEngine, CriticEngine, RewardModelEngine

    cls = {"actor": ActorEngine, "critic": CriticEngine, "reward": RewardModelEngine}[role]
    return cls(build(), replace(config, sequence_parallel_size=sp))


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every full gradient, by parameter name (shards gathered)."""
    return {
        n: full_tensor(p.grad).clone()
        for n, p in engine.module.named_parameters()
        if p.grad is not None
    }


def run_steps(engine, batch, steps: int = STEPS) -> list:
    """Per step: loss, metrics, grad norm, every gradient (before the step), outputs, and the
    parameters after it."""
    record = []
    for _ in range(steps):
        engine.optimizer.zero_grad(set_to_none=True)
        result = engine.forward_backward_batch(batch)
        grads = full_grads(engine)
        grad_norm = engine.optimizer_step()
        outputs = {k: v.clone() for k, v in result["model_output"].items()}
        record.append(
            (result["loss"], result["metrics"], grad_norm, grads, full_params(engine), outputs)
        )
    return record


def compare_steps(name: str, ref: list, got: list, worst: dict) -> None:
    """The TP tests' tolerances; ``worst`` keeps the largest differences seen, by kind."""

    def note(kind: str, value: float) -> None:
        case = worst.setdefault(name, {})
        case[kind] = max(case.get(kind, 0.0), value)

    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        what = f"{name} step {step}"
        assert abs(r[0] - g[0]) <= 1e-5 * max(1.0, abs(r[0])), (what, r[0], g[0])
        note("loss", abs(r[0] - g[0]))
        assert_metrics_close(r[1], g[1], what)
        for key, value in r[1].items():
            if value == value:  # NaN: a MIN/MAX metric without a value, checked equal above
                note("metric", abs(value - g[1][key]))
        assert abs(r[2] - g[2]) <= 1e-5 * max(1.0, r[2]), (what, "grad_norm", r[2], g[2])
        note("grad_norm", abs(r[2] - g[2]))
        assert r[3].keys() == g[3].keys(), (what, r[3].keys() ^ g[3].keys())
        for n in r[3]:  # fp32 sums over the ranks' tokens in another order: relative 1e-6
            scale = max(1.0, r[3][n].abs().max().item())
            err = (g[3][n] - r[3][n]).abs().max().item() if r[3][n].numel() else 0.0
            assert err <= 1e-6 * scale, f"{what} grad {n}: max |diff| = {err:.3g}"
            note("grad", err / scale)
        for n in r[4]:
            err = (g[4][n] - r[4][n]).abs().max().item()
            assert err <= 1e-5, f"{what} param {n}: max |diff| = {err:.3g}"
            note("param", err)
        assert r[5].keys() == g[5].keys(), (what, r[5].keys(), g[5].keys())
        for key in r[5]:
            assert g[5][key].shape == r[5][key].shape, (what, key, g[5][key].shape)
            err = (g[5][key] - r[5][key]).abs().max().item() if r[5][key].numel() else 0.0
            assert err <= 1e-5, f"{what} output {key}: max |diff| = {err:.3g}"
            note("output", err)


def write_json(tmp: Path, name: str, value) -> None:
    """``value`` as JSON in the run's ``out`` directory (the largest differences measured)."""
    (tmp / "out" / name).write_text(json.dumps(value, indent=1, sort_keys=True))
