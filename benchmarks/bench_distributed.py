"""Data parallelism: step time and memory per rank, 1 vs 2 ranks on the same global batch.

    python benchmarks/bench_distributed.py            # CPU: gloo ranks, ~1-2 minutes
    python benchmarks/bench_distributed.py --lora 8   # the same under LoRA

It launches this file under torchrun three times on one global mini-batch of uneven lengths
(full fine-tune of a small Qwen2-style model, AdamW, micro-batch size 4):

* 1 rank (the whole mini-batch, no sharding);
* 2 ranks with FSDP2, gradients reduced once per mini-batch (the engine's default);
* 2 ranks with FSDP2, gradients reduced after every micro-batch (for comparison).

Per rank it reports the median step time, the bytes of parameters + gradients + optimizer state
the rank holds after a step (what sharding divides by the number of ranks), the resident memory
after the warm-up step (model shards and optimizer state in place) and its peak during the timed
steps (Linux ``VmHWM``, reset after the warm-up: building the full model before sharding it and
creating the optimizer state are not part of a steady-state step). Every column is the maximum
over ranks. Every rank gets
``--threads-per-rank`` CPU threads (default 1: on a loaded machine, OpenMP threads that share
cores spin against each other and make the timing meaningless).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    """Return freed heap to the OS, then restart the peak-RSS counter (Linux ``clear_refs`` 5).

    Without this the peak would include building the full model before sharding it.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def worker(args: argparse.Namespace) -> None:
    import torch
    from tensordict import TensorDict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from microrl.configs.engine import ActorConfig, LoraConfig, OptimConfig
    from microrl.engine import ActorEngine
    from microrl.engine.parallel import distributed as D

    D.init_distributed()

    if args.sync_every_micro_batch:
        D.set_gradient_sync = lambda module, enabled: None  # FSDP2's default: always reduce
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=args.vocab,
        max_position_embeddings=1024,
    )
    engine = ActorEngine(
        Qwen2ForCausalLM(config),
        ActorConfig(
            micro_batch_size=4,
            optim=OptimConfig(lr=1e-5),
            lora=LoraConfig(rank=args.lora, alpha=2.0 * args.lora) if args.lora else LoraConfig(),
        ),
    )
    rank, world = D.rank(), D.world_size()  # data parallel only: the global rank is the dp rank
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=gen)
    seq = int(lengths.max())
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    batch = TensorDict(
        input_ids=torch.randint(0, args.vocab, (args.batch, seq), generator=gen),
        attention_mask=mask,
        loss_mask=mask & (torch.arange(seq)[None, :] >= lengths[:, None] // 2),
        old_logprobs=-torch.rand(args.batch, seq, generator=gen) * 3,
        advantages=torch.randn(args.batch, seq, generator=gen),
        batch_size=[args.batch],
    )
    mine = batch[list(range(rank, args.batch, world))]
    for _ in range(args.warmup):  # also creates the optimizer state
        engine.train_batch(mine)
    _reset_peak_rss()
    before = _status_bytes("VmRSS")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.train_batch(mine)
        times.append(time.perf_counter() - start)
    params = [p for p in engine.module.parameters()]
    trainable = [p for p in params if p.requires_grad]
    optim = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    result = {
        "rank": rank,
        "world": world,
        "step_s": statistics.median(times),
        "params_mb": sum(_local_bytes(p) for p in params) / 2**20,
        "grads_mb": sum(_local_bytes(p) for p in trainable) / 2**20,
        "optim_mb": sum(_local_bytes(v) for v in optim) / 2**20,
        "rss_before_mb": before / 2**20,
        "peak_rss_mb": _status_bytes("VmHWM") / 2**20,
        "n_params": sum(p.numel() for p in engine.model.parameters()),
    }
    out = Path(args.out) / f"rank{rank}.json"
    out.write_text(json.dumps(result))


def launch(nproc: int, threads: int, argv: list[str], extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            __file__,
            "--worker",
            "--out",
            tmp,
            *argv,
            *extra,
        ]
        subprocess.run(cmd, check=True, cwd=REPO, env=env, capture_output=True)
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--lora", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync-every-micro-batch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    argv = sys.argv[1:]
    runs = [
        ("1 rank (no sharding)", launch(1, args.threads_per_rank, argv, [])),
        ("2 ranks, FSDP2, reduce once per mini-batch", launch(2, args.threads_per_rank, argv, [])),
        (
            "2 ranks, FSDP2, reduce every micro-batch",
            launch(2, args.threads_per_rank, argv, ["--sync-every-micro-batch"]),
        ),
    ]
    first = runs[0][1][0]
    print(
        f"model: {first['n_params'] / 1e6:.2f}M params, hidden {args.hidden}, {args.layers} layers, "
        f"vocab {args.vocab}, lora rank {args.lora}; global batch {args.batch} sequences of "
        f"{args.min_len}-{args.max_len} tokens, micro-batch size 4; {args.threads_per_rank} CPU thread(s) per rank\n"
    )
    print(
        "| setup | step time (s) | params+grads+optimizer per rank (MB) | vs 1 rank | "
        "RSS after warm-up (MB) | peak RSS in a step (MB) | step transient (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    base_state = first["params_mb"] + first["grads_mb"] + first["optim_mb"]
    for name, results in runs:
        step = max(r["step_s"] for r in results)  # the slowest rank sets the pace
        state = max(r["params_mb"] + r["grads_mb"] + r["optim_mb"] for r in results)
        before = max(r["rss_before_mb"] for r in results)
        peak = max(r["peak_rss_mb"] for r in results)
        rise = max(r["peak_rss_mb"] - r["rss_before_mb"] for r in results)
        print(
            f"| {name} | {step:.3f} | {state:.1f} | {state / base_state:.2f}x | {before:.0f} "
            f"| {peak:.0f} | {rise:.0f} |"
        )


if __name__ == "__main__":
    main()
