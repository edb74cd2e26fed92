"""Per-rank memory of a tensor-parallel engine: TP=1 against TP=2, measured in the same run.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_tensor_parallel.py [--hidden 256]

Each rank first builds the single-process engine (the baseline, before any process group
exists), then the TP=2 engine over both ranks, and runs one mini-batch + AdamW step in each. It
reports per rank: parameter, gradient and optimizer-state bytes (the local shards of the DTensors:
what the rank holds), and the lm head's working set, the vocabulary tile buffers the fused /
vocab-parallel kernels allocate (2 buffers of ``rows x vocab_tile`` fp32, from the kernels' tile
rule) next to the ``[N, V]`` fp32 logits an eager head would hold. Ratios are TP=2 / TP=1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _model(hidden: int, layers: int, vocab: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=vocab,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    )


def _head_working_set(tokens: int, vocab_local: int, chunk: int = 1024) -> int:
    """Tile buffers of the fused / vocab-parallel kernel (their tile rule, 32 MiB fp32 tiles)."""
    rows = min(chunk, tokens)
    tile = max(1, min(vocab_local, max(128, (8 * 1024 * 1024) // chunk)))
    return 2 * rows * tile * 4


def measure(tp: int, args) -> dict[str, float]:
    from distributed_utils import make_batch

    from microrl.configs.engine import ActorConfig, OptimConfig
    from microrl.engine import ActorEngine

    config = ActorConfig(
        micro_batch_size=4,
        tensor_parallel_size=tp,
        optim=OptimConfig(name="adamw", lr=1e-4),
    )
    engine = ActorEngine(_model(args.hidden, args.layers, args.vocab), config)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch(lengths=(args.seq,) * args.rows, seq_len=args.seq)
    batch["input_ids"] = torch.randint(0, args.vocab, batch["input_ids"].shape, generator=gen)
    params = list(engine.module.parameters())
    start = time.perf_counter()
    engine.optimizer.zero_grad(set_to_none=True)
    engine.forward_backward_batch(batch)
    grads = _bytes(p.grad for p in params if p.grad is not None)
    engine.optimizer_step()
    seconds = time.perf_counter() - start
    state = [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
    vocab_local = -(-args.vocab // tp)
    return {
        "params": _bytes(params),
        "grads": grads,
        "optimizer": _bytes(state),
        "head_working_set": _head_working_set(4 * args.seq, vocab_local),
        "eager_logits": 4 * args.seq * args.vocab * 4,
        "step_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    world = os.environ.pop("WORLD_SIZE", None)  # the TP=1 baseline: no process group yet
    one = measure(1, args)
    if world is None:
        raise SystemExit("run under torchrun --nproc_per_node 2")
    os.environ["WORLD_SIZE"] = world
    two = measure(2, args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}, AdamW fp32")
        print(f"{'per rank':<18}{'TP=1':>12}{'TP=2':>12}{'ratio':>8}")
        for key in one:
            unit, scale = ("s", 1.0) if key == "step_s" else ("MiB", 2.0**20)
            a, b = one[key] / scale, two[key] / scale
            print(f"{key + ' (' + unit + ')':<18}{a:>12.2f}{b:>12.2f}{b / a:>8.2f}")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
