"""Memory of a LoRA engine with its frozen base in bf16 against fp32 (``EngineConfig.base_dtype``).

    python benchmarks/bench_base_dtype.py                   # Qwen2-style 57M model, ~1 minute
    python benchmarks/bench_base_dtype.py --qwen25-0.5b     # Qwen2.5-0.5B's shapes (random weights)

The same model (built from a config, no download), LoRA rank 8 on every linear layer, one
``train_batch`` of a token-budgeted mini-batch on the CPU, each base dtype in turn: the bytes of
the frozen parameters, of what trains (adapters, their gradients, AdamW state), and the peak of
the tensors a step allocates (``benchmarks/live_bytes.py``: activations, head buffers,
transients); their total is what the step holds at its peak. Prints the ratios bf16 / fp32
and what ``microrl.estimate_memory`` predicts. Without autocast (as here, on the CPU) a bf16
base computes in bf16 but peft casts each adapted layer's input to the fp32 adapters, so the
activations shrink little; under autocast (the CUDA default) those copies are bf16 too.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
from pathlib import Path

import torch
from tensordict import TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import ActorEngine, estimate_memory

MiB = 2**20


def _sibling(name: str):
    """A module of benchmarks/ by file (this directory is not a package)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _live_bytes():
    return _sibling("live_bytes").LiveBytes


def model_config(qwen25: bool) -> Qwen2Config:
    if qwen25:  # the shapes memory_table.py takes from the model card
        shapes = _sibling("memory_table").QWEN25["Qwen/Qwen2.5-0.5B-Instruct"]
        return Qwen2Config(max_position_embeddings=4096, **shapes)
    return Qwen2Config(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32768,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )


def make_batch(rows: int, width: int, vocab: int) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, width, dtype=torch.bool)
    loss_mask = mask.clone()
    loss_mask[:, : width // 2] = False
    return TensorDict(
        input_ids=torch.randint(0, vocab, (rows, width), generator=gen),
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=torch.randn(rows, width, generator=gen),
        old_logprobs=-torch.rand(rows, width, generator=gen) - 8,
        batch_size=[rows],
    )


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(model_cfg: Qwen2Config, base_dtype: str, rows: int, width: int) -> dict[str, float]:
    config = ActorConfig(
        max_tokens_per_micro_batch=rows * width,
        lora=LoraConfig(rank=8),
        base_dtype=base_dtype,
        dtype="float32",  # no autocast on the CPU: the bf16 base computes in bf16 itself
    )
    torch.manual_seed(0)
    engine = ActorEngine(Qwen2ForCausalLM(model_cfg), config)
    batch = make_batch(rows, width, model_cfg.vocab_size)
    engine.train_batch(batch)  # warm-up: gradients and optimizer state now exist
    gc.collect()
    with _live_bytes()() as live:
        engine.train_batch(batch)
    params = list(engine.model.parameters())
    frozen = nbytes(p for p in params if not p.requires_grad)
    trained = nbytes(p for p in params if p.requires_grad)
    state = nbytes(t for s in engine.optimizer.state.values() for t in s.values() if t.dim())
    estimate = estimate_memory(model_cfg, config, device="cpu")
    del engine
    gc.collect()
    return {
        "frozen": frozen / MiB,
        "trained": (2 * trained + state) / MiB,  # adapters + their gradients + AdamW moments
        "peak": live.peak / MiB,
        "estimate_frozen": estimate.weights / MiB,
        "estimate_peak": max(estimate.compute_peak, estimate.optimizer_transient) / MiB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qwen25-0.5b", dest="qwen25", action="store_true")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    model_cfg = model_config(args.qwen25)
    results = {
        dtype: measure(model_cfg, dtype, args.rows, args.width) for dtype in ("float32", "bfloat16")
    }
    n = sum(p.numel() for p in Qwen2ForCausalLM(model_cfg).parameters()) / 1e6
    print(
        f"{n:.1f}M-parameter Qwen2-style model, LoRA rank 8, {args.rows} x {args.width} tokens, CPU"
    )
    print(
        "| base dtype | frozen weights MiB | adapters + grads + AdamW MiB | step peak MiB "
        "(live bytes) | total MiB | estimate: weights, peak MiB |"
    )
    print("|---|---|---|---|---|---|")
    for dtype, r in results.items():
        r["total"] = r["frozen"] + r["trained"] + r["peak"]
        print(
            f"| {dtype} | {r['frozen']:.1f} | {r['trained']:.2f} | {r['peak']:.1f} | "
            f"{r['total']:.1f} | {r['estimate_frozen']:.1f}, {r['estimate_peak']:.1f} |"
        )
    full, half = results["float32"], results["bfloat16"]
    print(
        f"bf16 / fp32: frozen weights {half['frozen'] / full['frozen']:.3f}x, "
        f"trained state {half['trained'] / full['trained']:.3f}x, "
        f"step peak {half['peak'] / full['peak']:.3f}x, total {half['total'] / full['total']:.3f}x; "
        f"saved {full['frozen'] - half['frozen']:.1f} MiB of weights"
    )


if __name__ == "__main__":
    main()
