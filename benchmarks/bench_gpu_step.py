"""A real-size GRPO step on one GPU against TRL's GRPOTrainer, phase by phase.

    python benchmarks/bench_gpu_step.py                          # CUDA: every row, 2 pairs
    python benchmarks/bench_gpu_step.py --sizes 0.5b --rows lora --steps 1 --pairs 1
    python benchmarks/bench_gpu_step.py --device cpu --sizes tiny --prompts 2 --samples 2 \\
        --new-tokens 4 --prompt-tokens 4 --micro-batch 2 --mini-batch 2  # CI's shape

The step of examples/grpo_lora.py on one device: ``hf`` sampling of ``--prompts`` x
``--samples`` responses of exactly ``--new-tokens`` tokens, the old log-prob pass, then one pass
of AdamW updates over mini-batches of ``--mini-batch`` rows in micro-batches of
``--micro-batch``, no KL; and the same step in TRL's ``GRPOTrainer`` (``use_vllm=False``), its
arguments mapped from the same config by benchmarks/bench_trl.py's ``trl_args`` (same batch
layout, optimizer, clipping, loss normalisation; TRL recomputes the old log-probs because its
generation feeds several optimizer steps). The models are Qwen2.5-0.5B and -1.5B shaped (the
numbers of their config.json, in benchmarks/memory_table.py) with random weights, seeded alike
on both sides, since nothing can be downloaded on the lent GPU machines; the tokenizer has the
model's 151,936 ids (Qwen2.5's vocabulary padded as its embedding is) and an end-of-sequence
token one past them that the model cannot sample, so every response is ``--new-tokens`` long on
both sides (end of sequence suppressed). Prompts are ``--prompt-tokens`` random ids; the reward
is the share of even ids in a response (benchmarks/bench_async.py's task).

Rows (``--rows``): ``lora`` (LoRA rank ``--lora-rank`` on every linear layer but the head, the
frozen base stored in bf16 on CUDA on both sides), per size; ``full`` (a full fine-tune, float32
master weights) and ``offload`` (the same with ``actor.optim.cpu_offload=true``: FSDP2 over a
one-rank ``cpu:gloo,cuda:nccl`` group, parameters, gradients and AdamW on the host; then saved,
loaded into a fresh engine, checked bit-exact and stepped again: a resume) on the first size.
Every run is a fresh process (its log in ``--out-dir``, outputs/bench_gpu_step), microrl and TRL alternating, ``--pairs``
times; each runs one warm-up step and ``--steps`` timed ones. On CUDA bf16 autocast on both sides
(the engine's ``dtype=auto``, TRL's ``bf16=True``); on a CPU float32, one thread.

Per phase, the median over timed steps and pairs: generation (the ``generate`` call and its
layout), old log-probs (the no-grad pass), update (forward, backward and optimizer steps), and
the whole step (these plus scoring and bookkeeping): seconds, tokens per second (generated
tokens; the training phases: prompt and response tokens of every row per pass) and the peak GPU
memory allocated within the phase (CUDA; the process's peak RSS on a CPU). Then, per size and
row, the training phases' (old log-probs + update) tokens/s and peak memory of microrl as ratios
of TRL's against the goals (>= 1.5x and <= 0.6x). The last line (``KEY: ...``) is what
benchmarks/gpu_check.sh records. Without ``trl`` installed the TRL runs are skipped, and said so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks whose pieces this one reuses

from bench_trl import ROOT, peak_rss_mb, run_process, trl_args  # noqa: E402
from step_phases import PHASES, PhaseClock, rollout_boundaries, time_trl_phases  # noqa: E402

# The shapes: Qwen2.5's config.json numbers, kept in benchmarks/memory_table.py (with their
# source), or CI's "tiny", the same architecture small enough for a CPU test of seconds.
SIZES = {"0.5b": "Qwen/Qwen2.5-0.5B-Instruct", "1.5b": "Qwen/Qwen2.5-1.5B-Instruct", "tiny": None}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=True,
)
ROWS = ("lora", "full", "offload")
TRAINING = ("old_logprobs", "update")  # where the engine and its kernel differ from TRL's
GOAL_SPEED, GOAL_MEMORY = 1.5, 0.6  # issue 40: >= 1.5x TRL's tokens/s, <= 0.6x its peak memory


# ----------------------------------------------------------------------------- shared set-up
def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def step_config(args: argparse.Namespace, row: str) -> Any:
    """configs/grpo_lora.yaml with this benchmark's layout, for ``row`` (lora, full, offload)."""
    from microrl.configs.examples import GRPOExampleConfig
    from microrl.configs.loader import load_config
    from microrl.run.cli import CONFIG_DIR

    device = device_of(args.device)
    rank = args.lora_rank if row == "lora" else 0
    # LoRA's frozen base in bf16 on CUDA, as TRL gets a Qwen2.5 checkpoint (stored in bf16);
    # a full fine-tune keeps float32 master weights on both sides.
    base = "bfloat16" if rank and device.type == "cuda" else "float32"
    overrides = [
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.samples}",
        f"rollout.max_new_tokens={args.new_tokens}",
        f"actor.micro_batch_size={args.micro_batch}",
        f"train.mini_batch_size={args.mini_batch}",
        "train.ppo_epochs=1",
        "train.kl_metric_every=0",
        "actor.policy_loss.kl_coef=0.0",
        "actor.policy_loss.bypass_mode=false",  # the old log-prob pass runs, as in TRL here
        f"actor.lora.rank={rank}",
        f"actor.lora.alpha={2 * rank}",
        f"actor.optim.lr={args.lr}",
        f"actor.optim.cpu_offload={'true' if row == 'offload' else 'false'}",
        f"actor.device={device}",
        f"actor.base_dtype={base}",
        f"train.num_threads={1 if device.type == 'cpu' else 0}",
    ]
    return load_config(GRPOExampleConfig, CONFIG_DIR / "grpo_lora.yaml", overrides)


def shape(size: str) -> dict[str, Any]:
    """The Qwen2Config numbers of ``size`` (imported here: the driver stays light)."""
    from memory_table import QWEN25

    return TINY if SIZES[size] is None else QWEN25[SIZES[size]]


def build_model(size: str, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """A Qwen2 causal LM of ``size``'s shape with seeded random weights, built on ``device``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    with device:
        return AutoModelForCausalLM.from_config(Qwen2Config(**shape(size)), dtype=dtype)


def model_dtype(cfg: Any) -> torch.dtype:
    return torch.bfloat16 if cfg.actor.base_dtype == "bfloat16" else torch.float32


def tokens(args: argparse.Namespace) -> dict[str, int]:
    """Tokens per phase of one step: generated ones, then every row's prompt and response."""
    rows = args.prompts * args.samples
    return {
        "generation": rows * args.new_tokens,
        "training": rows * (args.prompt_tokens + args.new_tokens),
    }


# ----------------------------------------------------------------------------- microrl
def run_microrl(args: argparse.Namespace, row: str, size: str) -> dict[str, Any]:
    """The recipe's step (microrl/recipes/grpo.py) 1 + ``args.steps`` times, phase by phase."""
    from bench_async import RandomPromptTask, id_tokenizer

    from microrl.engine import ActorEngine
    from microrl.recipes.grpo import estimate_advantages
    from microrl.rollout import HFRollout
    from microrl.run import sampling_params, score_rollout

    cfg = step_config(args, row)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    device = device_of(args.device)
    vocab = shape(size)["vocab_size"]
    tokenizer = id_tokenizer(vocab)
    engine = ActorEngine(build_model(size, model_dtype(cfg), device, args.seed), cfg.actor)
    sampler, params = HFRollout(engine, tokenizer), sampling_params(cfg)
    task, rng, clock = (
        RandomPromptTask(vocab, args.prompt_tokens),
        random.Random(args.seed),
        PhaseClock(device),
    )
    rows = args.prompts * args.samples
    for step in range(1, args.steps + 2):  # the first warms up
        clock.begin_step()
        problems = task.sample(rng, args.prompts)
        with clock.phase("generation"):
            rollout = sampler.generate([p.prompt for p in problems], params)
        check_lengths(int(rollout.batch["loss_mask"].sum()), rows * args.new_tokens)
        scores = score_rollout(task, problems, rollout)
        rollout, scores = rollout.to(engine.device), scores.to(engine.device)
        with clock.phase("old_logprobs"):
            estimate_advantages(engine, rollout, scores, cfg, step=step)
        batch = rollout.batch
        with clock.phase("update"):
            for part in torch.randperm(rows).tensor_split(rows // args.mini_batch):
                engine.train_batch(batch[part])
        clock.end_step()
    result = {"phases": clock.summary()}
    if row == "offload":
        result["resume"] = resume_check(engine, batch, args, size, cfg)
    return result


def check_lengths(got: int, want: int) -> None:
    if got != want:
        raise RuntimeError(
            f"{got} response tokens instead of {want}: an end of sequence was sampled"
        )


def state_checksum(engine: Any) -> float:
    """The float64 sum of every parameter and optimizer-state tensor of ``engine`` (one rank:
    a DTensor's local shard is the whole tensor)."""
    total = 0.0
    tensors = [p for p in engine.module.parameters()]
    for state in engine.optimizer.state.values():
        tensors += [t for t in state.values() if torch.is_tensor(t)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.detach().double().sum().item()
    return total


def resume_check(
    engine: Any, batch: Any, args: argparse.Namespace, size: str, cfg: Any
) -> dict[str, Any]:
    """Save ``engine``, load it into a fresh one built from other random weights (what
    ``--resume`` does), check its parameters and optimizer state bit-exact, and run one more
    update on it (both engines live: under the offload their state is on the host)."""
    from microrl.engine import ActorEngine

    device = device_of(args.device)
    before = state_checksum(engine)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        engine.save_checkpoint(folder)
        saved = time.perf_counter() - start
        fresh = ActorEngine(build_model(size, model_dtype(cfg), device, args.seed + 1), cfg.actor)
        start = time.perf_counter()
        fresh.load_checkpoint(folder)
        loaded = time.perf_counter() - start
    after = state_checksum(fresh)
    start = time.perf_counter()
    fresh.train_batch(batch[: args.mini_batch])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "save_s": saved,
        "load_s": loaded,
        "exact": before == after,
        "checksum": before,
        "update_after_s": time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- TRL
def run_trl(args: argparse.Namespace, row: str, size: str) -> dict[str, Any]:
    """TRL's GRPOTrainer over 1 + ``args.steps`` generations of the same layout, its methods
    wrapped on the instance to time the phases."""
    import peft
    from bench_async import RandomPromptTask, id_tokenizer
    from datasets import Dataset
    from trl import GRPOTrainer

    cfg = step_config(args, row)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    device = device_of(args.device)
    vocab = shape(size)["vocab_size"]
    task = RandomPromptTask(vocab, args.prompt_tokens)
    problems = task.sample(random.Random(args.seed), args.prompts * (args.steps + 1))
    lora = cfg.actor.lora
    peft_config = None
    if lora.rank:
        peft_config = peft.LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=lora.target_modules or "all-linear", bias="none",
        )  # fmt: skip
    out_dir = str(Path(args.out_dir) / f"trl-{row}-{size}")

    lengths: list[int] = []  # of every completion, in tokens (one word each)

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        lengths.extend(len(text.split()) for text in completions)
        return task.score(completions, problems)

    trainer = GRPOTrainer(
        model=build_model(size, model_dtype(cfg), device, args.seed),
        reward_funcs=reward,
        args=trl_args(cfg, args.steps + 1, out_dir, device=device.type),
        train_dataset=Dataset.from_dict({"prompt": [p.prompt for p in problems]}),
        processing_class=id_tokenizer(vocab),
        peft_config=peft_config,
    )
    clock = PhaseClock(device)
    updates = args.prompts * args.samples // args.mini_batch
    trainer.add_callback(rollout_boundaries(clock, updates))
    time_trl_phases(trainer, clock)
    trainer.train()
    check_lengths(sum(lengths), len(lengths) * args.new_tokens)
    if len(clock.seconds) != args.steps + 1:
        raise RuntimeError(f"{len(clock.seconds)} generations instead of {args.steps + 1}")
    return {"phases": clock.summary()}


# ----------------------------------------------------------------------------- driver
def plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The runs of one pair, in order: (row, size, side), microrl before TRL each time."""
    runs = []
    for row in args.rows:
        sizes = args.sizes if row == "lora" else args.sizes[:1]
        sides = ("microrl",) if row == "offload" else ("microrl", "trl")
        runs += [(row, size, side) for size in sizes for side in sides]
    return runs


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    have_trl = importlib.util.find_spec("trl") is not None
    if not have_trl:
        print("trl is not installed: TRL's runs are skipped (pip install trl)", flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for pair in range(1, args.pairs + 1):
        for row, size, side in plan(args):
            if side == "trl" and not have_trl:
                continue
            name = f"{side}-{row}-{size}-{pair}"
            command = [sys.executable, str(Path(__file__).resolve()), *args.argv]
            command += ["--worker", side, "--row", row, "--size", size]
            command += ["--result", str(out / f"{name}.json")]
            r = run_process(command, out / f"{name}.log", out / f"{name}.json", name)
            r.update(side=side, row=row, size=size, pair=pair)
            results.append(r)
            print(run_line(r, args), flush=True)
    return results


def run_line(r: dict[str, Any], args: argparse.Namespace) -> str:
    phases = r["phases"]
    parts = [f"{name} {phases[name]['s']:.2f} s" for name in (*PHASES, "step")]
    line = f"{r['side']:7s} {r['row']:7s} {r['size']:5s} pair {r['pair']}: " + ", ".join(parts)
    if r.get("resume"):
        resume = r["resume"]
        line += (
            f"; resume: save {resume['save_s']:.1f} s, load {resume['load_s']:.1f} s, "
            f"{'bit-exact' if resume['exact'] else 'NOT bit-exact'}"
        )
    return line


def median_phases(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the median seconds and the largest peak over the runs ``results``; and the
    largest process RSS (MiB)."""
    out: dict[str, Any] = {"rss_mib": max(r["peak_rss_mib"] for r in results)}
    for name in (*PHASES, "step"):
        peaks = [r["phases"][name]["peak_mib"] for r in results]
        out[name] = {
            "s": statistics.median(r["phases"][name]["s"] for r in results),
            "peak_mib": None if None in peaks else max(peaks),
        }
    return out


def peak_of(phases: dict[str, Any], names: tuple[str, ...]) -> float | None:
    """The largest GPU peak (MiB) of the phases ``names``; None without CUDA."""
    peaks = [phases[name]["peak_mib"] for name in names]
    return None if None in peaks else max(peaks)


def table_row(size: str, row: str, side: str, phases: dict[str, Any], count: dict[str, int]) -> str:
    cells = [size, row, side]
    for name in PHASES:
        n = count["generation" if name == "generation" else "training"]
        cells.append(f"{phases[name]['s']:.2f} ({n / phases[name]['s']:.0f})")
    peak = peak_of(phases, PHASES)
    cells.append(f"{phases['step']['s']:.2f}")
    cells.append(f"RSS {phases['rss_mib']:.0f}" if peak is None else f"{peak:.0f}")
    return "| " + " | ".join(cells) + " |"


def ratio_line(mine: dict[str, Any], trl: dict[str, Any]) -> tuple[str, str]:
    """The training phases of microrl (``mine``) against TRL's, with the goals: the long line
    and the short one of the KEY."""
    seconds = lambda phases: sum(phases[name]["s"] for name in TRAINING)  # noqa: E731
    speed = seconds(trl) / seconds(mine)  # the same tokens on both sides
    verdict = lambda ok: "met" if ok else "not met"  # noqa: E731
    line = f"training phases {speed:.2f}x TRL's tokens/s (goal >= {GOAL_SPEED}x: "
    line += f"{verdict(speed >= GOAL_SPEED)})"
    short = f"{speed:.2f}x tokens/s"
    mine_peak, trl_peak = peak_of(mine, TRAINING), peak_of(trl, TRAINING)
    if mine_peak is not None and trl_peak:
        memory = mine_peak / trl_peak
        line += f", {memory:.2f}x its peak memory (goal <= {GOAL_MEMORY}x: "
        line += f"{verdict(memory <= GOAL_MEMORY)})"
        short += f", {memory:.2f}x memory"
    generation = trl["generation"]["s"] / mine["generation"]["s"]
    return line + f"; generation {generation:.2f}x TRL's tokens/s", short


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Prints the table (medians over pairs; peak: GPU MiB, or the process's RSS on a CPU) and
    the ratio lines; returns the ratios' short forms."""
    print("\n| size | row | side | generation s (tok/s) | old log-probs s (tok/s) | ", end="")
    print("update s (tok/s) | step s | peak MiB |\n|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for row, size, side in plan(args):
        runs = [r for r in results if (r["row"], r["size"], r["side"]) == (row, size, side)]
        if runs:
            phases = groups.setdefault((size, row), {})[side] = median_phases(runs)
            print(table_row(size, row, side, phases, tokens(args)))
    keys = []
    for (size, row), sides in groups.items():
        if "trl" in sides:
            line, short = ratio_line(sides["microrl"], sides["trl"])
            print(f"{size} {row}: {line}")
            keys.append(f"{size} {row} {short}")
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cuda or cpu")
    parser.add_argument("--sizes", default="0.5b,1.5b", help=f"model shapes: {', '.join(SIZES)}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"rows: {', '.join(ROWS)}")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per forward/backward")
    parser.add_argument("--mini-batch", type=int, default=128, help="rows per optimizer step")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (+1 warm-up)")
    parser.add_argument("--pairs", type=int, default=2, help="(microrl, TRL) rounds")
    parser.add_argument("--json", help="write every run's result here")
    parser.add_argument(
        "--out-dir",
        default=str(ROOT / "outputs" / "bench_gpu_step"),
        help="each run's log and result, and TRL's output_dir",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the runs one pair would make, run nothing"
    )
    parser.add_argument("--worker", choices=("microrl", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    args.sizes = args.sizes.split(",")
    args.rows = args.rows.split(",")
    unknown = sorted({*args.sizes} - set(SIZES)) + sorted({*args.rows} - set(ROWS))
    if unknown:
        parser.error(f"unknown sizes or rows: {unknown}")
    rows = args.prompts * args.samples
    if rows % args.mini_batch or args.mini_batch % args.micro_batch:
        parser.error("--mini-batch must divide prompts x samples and --micro-batch --mini-batch")

    if args.worker:
        run = run_microrl if args.worker == "microrl" else run_trl
        result = run(args, args.row, args.size)
        result["peak_rss_mib"] = peak_rss_mb()
        Path(args.result).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return

    if args.dry_run:
        for row, size, side in plan(args):
            print(f"{side} {row} {size}")
        return
    args.argv = argv
    device = device_of(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"device: {name}; {args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens",
        flush=True,
    )
    results = run_all(args)
    keys = report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "runs": results}, indent=1) + "\n")
    resumed = [r["resume"] for r in results if r.get("resume")]
    if resumed:
        keys.append(
            "offload resume "
            + ("bit-exact" if all(r["exact"] for r in resumed) else "NOT bit-exact")
        )
    print("KEY: " + ("; ".join(keys) if keys else "microrl only (no trl)"))
    if resumed and not all(r["exact"] for r in resumed):
        sys.exit(1)


if __name__ == "__main__":
    main()
