"""Vocab-parallel lm-head kernel: communication per call, and time with TP=2 vs TP=1.

    python benchmarks/bench_vocab_parallel.py                      # CPU, gloo, ~1 minute
    python benchmarks/bench_vocab_parallel.py --tokens 2048 --hidden 512 --vocab 32768

It launches this file under torchrun twice, one CPU thread per rank:

* 1 rank: ``fused_linear_logprob`` on the whole ``[V, H]`` weight (the single-device kernel), and
  ``vocab_parallel_linear_logprob`` with ``group=None`` (the same work without communication);
* 2 ranks (gloo): ``vocab_parallel_linear_logprob``, each rank holding a ``[ceil(V/2), H]`` shard
  (the last padded when V is odd).

Each step is forward + backward (gradients to hidden and weight) of
``sum(g1 * logprobs) + sum(g2 * entropy)``, float32 (``vocab_parallel_linear_loss``: the same
loss run inside the head, its gradients formed in forward on kept tiles), ``--steps`` timed steps after a warm-up;
the table shows the median step time (wall, and the process CPU time: steadier on a shared
machine), the maximum over ranks. Every ``dist.all_reduce`` the kernel issues is recorded: its
bytes per call, forward (statistics) and backward (the hidden gradient), against the
``N x V x 4`` bytes of the float32 logits that an all-gather of logits would move.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from microrl.kernels import (
        fused_linear_logprob,
        vocab_parallel_linear_logprob,
        vocab_parallel_linear_loss,
    )

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    n, h, v = args.tokens, args.hidden, args.vocab
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * h**-0.5
    targets = torch.randint(0, v, (n,), generator=g)
    g1, g2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    rows = -(-v // world)
    shard = torch.zeros(rows, h)
    real = weight[rank * rows : (rank + 1) * rows]
    shard[: real.shape[0]] = real
    group = None
    if world > 1:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    log: list[tuple[str, int]] = []  # (phase, bytes) of every all_reduce
    phase = "forward"
    if world > 1:
        real_all_reduce = dist.all_reduce

        def recorded(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            log.append((phase, tensor.numel() * tensor.element_size()))
            return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = recorded

    def step(kind: str) -> None:
        nonlocal phase
        hh = hidden.clone().requires_grad_()
        if kind == "fused":
            w = weight.clone().requires_grad_()
            phase = "forward"
            lp, ent = fused_linear_logprob(hh, w, targets, validate=False)
        elif kind == "vocab_parallel_loss":  # the same loss inside the head, gradients in forward
            w = shard.clone().requires_grad_()
            phase = "forward"

            def loss_fn(start, end, lp, ent):
                return (lp * g1[start:end]).sum() + (ent * g2[start:end]).sum(), None

            out = vocab_parallel_linear_loss(
                hh, w, targets, loss_fn, group=group, vocab_start=rank * rows, vocab_size=v,
                with_entropy=True, validate=False,
            )  # fmt: skip
            phase = "backward"
            out.loss.backward()
            return
        else:
            w = shard.clone().requires_grad_()
            phase = "forward"
            lp, ent = vocab_parallel_linear_logprob(
                hh, w, targets, group=group, vocab_start=rank * rows, vocab_size=v, validate=False
            )
        phase = "backward"
        ((lp * g1).sum() + (ent * g2).sum()).backward()

    kinds = ["vocab_parallel", "vocab_parallel_loss"]
    kinds = ["fused", *kinds] if world == 1 else kinds
    result = {}
    for kind in kinds:
        step(kind)  # warm-up
        times, cpu = [], []
        for _ in range(args.steps):
            log.clear()
            if world > 1:
                dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            step(kind)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        result[kind] = {
            "median_s": statistics.median(times),
            "cpu_s": statistics.median(cpu),
            "forward_bytes": sum(b for p, b in log if p == "forward"),
            "backward_bytes": sum(b for p, b in log if p == "backward"),
            "calls": len(log),
        }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def launch(nproc: int, argv: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
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
        ]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{nproc}-rank run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="N, rows")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32767, help="odd: the last shard is padded")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    argv = ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    argv += ["--steps", str(args.steps)]
    one = launch(1, argv)[0]
    two = launch(2, argv)
    n, h, v = args.tokens, args.hidden, args.vocab
    logits = n * v * 4
    base = one["fused"]["median_s"]
    print(f"N={n} H={h} V={v}, float32, fwd+bwd, 1 thread per rank; logits N*V*4 = {logits} B")
    print(
        "| setup | step s | vs TP=1 fused | CPU s per rank | all_reduce calls | forward bytes "
        "| backward bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = [
        ("TP=1, fused_linear_logprob", one["fused"]),
        ("TP=1, vocab_parallel (group=None)", one["vocab_parallel"]),
        ("TP=2, vocab_parallel (max over ranks)", _max_over_ranks(two, "vocab_parallel")),
        ("TP=1, vocab_parallel_linear_loss (group=None)", one["vocab_parallel_loss"]),
        ("TP=2, vocab_parallel_linear_loss", _max_over_ranks(two, "vocab_parallel_loss")),
    ]
    for name, r in rows:
        print(
            f"| {name} | {r['median_s']:.3f} | {r['median_s'] / base:.2f}x | {r['cpu_s']:.3f} | "
            f"{r['calls']} | "
            f"{r['forward_bytes']} ({r['forward_bytes'] / logits:.2e} of N*V*4) | "
            f"{r['backward_bytes']} ({r['backward_bytes'] / logits:.2e} of N*V*4) |"
        )
    fwd = two[0]["vocab_parallel"]["forward_bytes"]
    print(f"forward bytes per token per rank: {fwd / n:.0f} (4 floats of 4 bytes: max, S, A, z_t)")


def _max_over_ranks(results: list[dict], kind: str) -> dict:
    per = [r[kind] for r in results]
    return {key: max(p[key] for p in per) for key in per[0]}


if __name__ == "__main__":
    main()
