"""Engine benchmarks on CPU, as ratios measured in the same run (issue 4).

    python benchmarks/bench_engine.py            # all three, ~3-5 minutes on 2 busy cores
    python benchmarks/bench_engine.py --quick    # smaller sizes, a smoke run

1. Overhead: ``forward_backward_batch`` (one micro-batch, PPO loss) against a hand-written loop
   (``model(...).logits -> log_softmax -> PPO loss -> backward``) on the same batch and weights,
   eager head and fused head, at a small and a large vocabulary.
2. Memory: peak RSS of one ``forward_backward_batch`` over 8 micro-batches against 1 micro-batch
   of the same size, each in a fresh process (peak RSS only grows within a process).
3. Packing: tokens/s of packed rows against padded rows for lengths spread over 16..512.

Timings are medians over interleaved repetitions (A, B, A, B, ...) so that load from other
processes on a shared machine hits every variant alike; ratios are more stable than absolutes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch
from tensordict import TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM

from microrl.configs import ActorConfig
from microrl.engine import ActorEngine

CLIP = 0.2  # PPO clip range of both the engine's default loss and the hand loop


def build_model(vocab: int, hidden: int = 256, layers: int = 4, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def make_batch(lengths: list[int], seq_len: int, vocab: int, seed: int = 0) -> TensorDict:
    """Right-padded rows; the second half of each row is the response."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=gen)
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    loss_mask = torch.zeros_like(mask)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
        loss_mask[b, max(1, n // 2) : n] = True
    return TensorDict(
        input_ids=ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=torch.randn(rows, seq_len, generator=gen),
        old_logprobs=-torch.rand(rows, seq_len, generator=gen) * 5 - 5,
        batch_size=[rows],
    )


def hand_loop(model: torch.nn.Module, batch: TensorDict, rows_per_step: int) -> None:
    """The minimal baseline: right-padded micro-batches in caller order, each cut to its longest
    row (the usual "pad to the longest" collate)."""
    n_tokens = batch["loss_mask"].sum()
    for start in range(0, batch.batch_size[0], rows_per_step):
        mb = batch[start : start + rows_per_step]
        width = int(mb["attention_mask"].sum(1).max())
        mb = mb.apply(lambda t, w=width: t[:, :w])
        ids, mask = mb["input_ids"], mb["attention_mask"]
        logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        logprobs = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logprobs - mb["old_logprobs"][:, 1:])
        adv = mb["advantages"][:, 1:]
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
        (torch.where(mb["loss_mask"][:, 1:], loss, 0.0).sum() / n_tokens).backward()


def timed(variants: dict, reps: int) -> dict[str, float]:
    """Best (minimum) seconds per call of each variant over interleaved repetitions, after one
    warm-up call each: on a shared machine other load only ever adds time, so the minimum is the
    least disturbed measurement."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name, (fn, zero) in variants.items():
            zero()
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def engine_for(model, **config) -> ActorEngine:
    defaults = {"micro_batch_size": None, "optim": None}
    defaults.update(config)
    kwargs = {k: v for k, v in defaults.items() if k != "optim" or v is not None}
    return ActorEngine(model, ActorConfig(**kwargs))


def bench_overhead(vocab: int, rows: int, seq_len: int, reps: int) -> dict[str, float]:
    model = build_model(vocab)
    batch = make_batch([seq_len] * rows, seq_len, vocab)
    eager = engine_for(model, micro_batch_size=rows, use_fused_kernel=False)
    fused = engine_for(model, micro_batch_size=rows, use_fused_kernel=True)
    assert fused.uses_fused_kernel and not eager.uses_fused_kernel

    def zero():
        model.zero_grad(set_to_none=True)

    result = timed(
        {
            "hand loop": (lambda: hand_loop(model, batch, rows), zero),
            "engine eager": (lambda: eager.forward_backward_batch(batch), zero),
            "engine fused": (lambda: fused.forward_backward_batch(batch), zero),
        },
        reps,
    )
    return result


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _reset_peak() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_kib() -> int:
    """``VmHWM``: not ``ru_maxrss``, which a child inherits from its parent's peak on Linux."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def memory_child(micro_batches: int, rows_per_micro: int, seq_len: int, vocab: int) -> None:
    """Measurements in this fresh process; prints JSON (KiB).

    ``cold``: the first call (gradients are created during it); ``warm``: a second call with the
    gradient buffers kept (zeroed, not freed), the steady state of training.
    """
    torch.set_num_threads(1)
    model = build_model(vocab)
    engine = engine_for(model, micro_batch_size=rows_per_micro)
    batch = make_batch([seq_len] * (rows_per_micro * micro_batches), seq_len, vocab)
    out = {}
    for phase in ("cold", "warm"):
        gc.collect()
        baseline = _rss_kib()
        reset = _reset_peak()
        engine.forward_backward_batch(batch)
        out[phase] = {"baseline": baseline, "peak": _peak_kib(), "reset": reset}
        model.zero_grad(set_to_none=False)
    print(json.dumps(out))


# glibc keeps freed blocks in its arenas, so RSS would also measure fragmentation; serving large
# blocks by mmap (returned to the OS on free) makes the RSS high-water mark track live tensors.
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def bench_memory(rows_per_micro: int, seq_len: int, vocab: int) -> dict[int, dict]:
    out = {}
    for n in (1, 8):
        cmd = [sys.executable, __file__, "--memory-child", str(n), str(rows_per_micro)]
        cmd += [str(seq_len), str(vocab)]
        env = {**os.environ, **_MALLOC_ENV}
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        out[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def bench_packing(rows: int, reps: int, vocab: int, max_len: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(16, max_len + 1, (rows,), generator=gen).tolist()
    batch = make_batch(lengths, max_len, vocab, seed=1)
    model = build_model(vocab)
    rows_per_micro = 4
    budget = rows_per_micro * max_len  # the same worst-case micro-batch size for every variant
    padded = engine_for(model, micro_batch_size=rows_per_micro)
    packed = engine_for(model, max_tokens_per_micro_batch=budget, pack_sequences=True)

    def zero():
        model.zero_grad(set_to_none=True)

    seconds = timed(
        {
            "hand loop, padded": (lambda: hand_loop(model, batch, rows_per_micro), zero),
            "engine padded (length-sorted)": (lambda: padded.forward_backward_batch(batch), zero),
            "engine packed": (lambda: packed.forward_backward_batch(batch), zero),
        },
        reps,
    )
    tokens = sum(lengths)
    return {name: tokens / s for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: least sensitive to other load)"
    )
    parser.add_argument(
        "--only", choices=["overhead", "memory", "packing"], help="run one benchmark only"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant")
    parser.add_argument("--memory-child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(*args.memory_child)
        return
    torch.set_num_threads(args.threads)
    quick = args.quick
    reps = args.reps or (2 if quick else 5)
    rows, seq_len = (4, 128) if quick else (8, 256)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, reps={reps}\n")

    run = {args.only} if args.only else {"overhead", "memory", "packing"}
    if "overhead" in run:
        bench_overhead_table(quick, rows, seq_len, reps)
    if "memory" in run:
        bench_memory_table(seq_len)
    if "packing" in run:
        bench_packing_table(quick, reps)


def bench_overhead_table(quick: bool, rows: int, seq_len: int, reps: int) -> None:
    print("1. forward_backward_batch vs hand loop (one micro-batch, no padding), best s per call")
    for vocab in (8192, 32768 if quick else 65536):
        t = bench_overhead(vocab, rows, seq_len, reps)
        base = t["hand loop"]
        print(
            f"   vocab {vocab:6d}: hand {base:.3f}s | engine eager {t['engine eager']:.3f}s "
            f"({t['engine eager'] / base:.3f}x) | engine fused {t['engine fused']:.3f}s "
            f"({t['engine fused'] / base:.3f}x)"
        )


def bench_memory_table(seq_len: int) -> None:
    print("\n2. peak RSS of one call, 8 micro-batches vs 1 micro-batch of 4 rows (fresh processes)")
    mem = bench_memory(rows_per_micro=4, seq_len=seq_len, vocab=8192)
    for phase in ("warm", "cold"):
        one, eight = mem[1][phase], mem[8][phase]
        grow1, grow8 = one["peak"] - one["baseline"], eight["peak"] - eight["baseline"]
        print(
            f"   {phase}: peak {one['peak'] / 1024:.0f} vs {eight['peak'] / 1024:.0f} MiB -> "
            f"{eight['peak'] / one['peak']:.3f}x; growth during the call {grow1 / 1024:.0f} vs "
            f"{grow8 / 1024:.0f} MiB -> {grow8 / max(grow1, 1):.3f}x (peak reset: {one['reset']})"
        )


def bench_packing_table(quick: bool, reps: int) -> None:
    print("\n3. packed vs padded, lengths uniform in 16..512, tokens/s (real tokens)")
    rate = bench_packing(rows=8 if quick else 16, reps=max(2, reps - 2), vocab=8192, max_len=512)
    base = rate["hand loop, padded"]
    for name, value in rate.items():
        print(f"   {name:32s} {value:8.0f} tok/s  ({value / base:.2f}x hand loop padded)")


if __name__ == "__main__":
    main()
