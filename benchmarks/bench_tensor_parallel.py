"""Per-rank memory and step time of a tensor-parallel engine: TP=1 against TP=2, in the same run.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_tensor_parallel.py [--hidden 256]

Each rank first builds the single-process engine (the baseline, before any process group
exists), then the TP=2 engine over both ranks, and runs mini-batch + AdamW steps in each. It
reports per rank: parameter, gradient and optimizer-state bytes (the local shards of the DTensors:
what the rank holds); the measured peak bytes allocated by one training step (forward, backward,
optimizer step) and by the lm head alone (the fused kernel at TP=1, the vocab-parallel kernel on
the rank's shard at TP=2; forward + backward of one micro-batch), both from ``live_bytes.py``,
next to the ``[N, V]`` fp32 logits an eager head would hold; and step times: the first step at a
micro-batch width not seen before, and a step at a seen one. Ratios are TP=2 / TP=1.
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


def _head_peak(engine, tokens: int, seed: int = 0) -> int:
    """Peak bytes the lm head's kernel allocates for ``tokens`` rows, forward + backward."""
    from live_bytes import LiveBytes

    from microrl.kernels import fused_linear_logprob, vocab_parallel_linear_logprob

    weight = engine.model.get_output_embeddings().weight.detach().requires_grad_()
    head = vocab_parallel_linear_logprob if hasattr(weight, "to_local") else fused_linear_logprob
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, weight.shape[1], generator=gen).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (tokens,), generator=gen)
    with LiveBytes() as live:
        logprobs, entropy = head(hidden, weight, targets)
        (logprobs.sum() + entropy.sum()).backward()
    return live.peak


def _batch(args, seq: int):
    from distributed_utils import make_batch

    gen = torch.Generator().manual_seed(seq)
    batch = make_batch(lengths=(seq,) * args.rows, seq_len=seq)
    batch["input_ids"] = torch.randint(0, args.vocab, batch["input_ids"].shape, generator=gen)
    return batch


def _step(engine, batch) -> float:
    start = time.perf_counter()
    engine.optimizer.zero_grad(set_to_none=True)
    engine.forward_backward_batch(batch)
    engine.optimizer_step()
    return time.perf_counter() - start


def measure(tp: int, args) -> dict[str, float]:
    from live_bytes import LiveBytes

    from microrl.configs.engine import ActorConfig, OptimConfig
    from microrl.engine import ActorEngine

    config = ActorConfig(
        micro_batch_size=4,
        tensor_parallel_size=tp,
        fuse_loss=not args.unfused_loss,
        optim=OptimConfig(name="adamw", lr=1e-4),
    )
    engine = ActorEngine(_model(args.hidden, args.layers, args.vocab), config)
    params = list(engine.module.parameters())
    new_width = _step(engine, _batch(args, args.seq))  # the first step: also warms up
    narrower = _batch(args, args.seq * 3 // 4)
    new_width = _step(engine, narrower)  # a width not seen before
    seen_width = _step(engine, narrower)
    engine.optimizer.zero_grad(set_to_none=True)
    with LiveBytes() as live:  # a steady step: the optimizer state exists already
        engine.forward_backward_batch(_batch(args, args.seq))
        grads = _bytes(p.grad for p in params if p.grad is not None)
        engine.optimizer_step()
    state = [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
    return {
        "params": _bytes(params),
        "grads": grads,
        "optimizer": _bytes(state),
        "step_peak": live.peak,
        "head_peak": _head_peak(engine, 4 * args.seq),
        "eager_logits": 4 * args.seq * args.vocab * 4,
        "step_new_width_s": new_width,
        "step_seen_width_s": seen_width,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument(
        "--unfused-loss", action="store_true", help="kernel, then the loss (fuse_loss=False)"
    )
    args = parser.parse_args()
    world = os.environ.pop("WORLD_SIZE", None)  # the TP=1 baseline: no process group yet
    one = measure(1, args)
    if world is None:
        raise SystemExit("run under torchrun --nproc_per_node 2")
    os.environ["WORLD_SIZE"] = world
    two = measure(2, args)
    if int(os.environ.get("RANK", "0")) == 0:
        loss = "kernel + loss" if args.unfused_loss else "fused loss"
        print(f"Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}, AdamW, {loss}")
        print(f"{'per rank':<24}{'TP=1':>12}{'TP=2':>12}{'ratio':>8}")
        for key in one:
            unit, scale = ("s", 1.0) if key.endswith("_s") else ("MiB", 2.0**20)
            a, b = one[key] / scale, two[key] / scale
            print(f"{key + ' (' + unit + ')':<24}{a:>12.2f}{b:>12.2f}{b / a:>8.2f}")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
