"""End to end: microrl's main job (examples/grpo_lora.py) against TRL's GRPOTrainer, same setup.

    python3 -m venv ../trlenv                 # beside the clone, the setup the README measured
    ../trlenv/bin/pip install torch==2.13.0   # the CPU wheel
    ../trlenv/bin/pip install -e . "trl==1.16.0" \\
        transformers==5.19.0 peft==0.21.2 accelerate==1.15.0   # pinned to the project venv's

    .venv/bin/python benchmarks/bench_trl.py                        # 3 pairs of 100 steps
    .venv/bin/python benchmarks/bench_trl.py --steps 5 --pairs 1    # a quick check

TRL's runs use ``--trl-python`` (default ../trlenv/bin/python, which holds microrl too, editable,
for the model, task and evaluator; the project venv's own TRL, which the ``test`` extra installs
for benchmarks/bench_gpu_step.py, works as well: ``--trl-python .venv/bin/python``). Runs alternate (microrl,
TRL, microrl, ...), each in a fresh offline process (``HF_HUB_OFFLINE=1``; its log in
outputs/bench_trl/<side>-<pair>.log). Per run: the RL time (wall time from the first step's start
to the last step's end: no model loading, no evaluation) and its share per step (a step = one
rollout of 128 prompts x 8 samples and its 4 optimizer steps), the peak RSS (VmHWM, after loading,
training and an evaluation), the held-out greedy accuracy on the task's 500 eval prompts (both
scored by microrl's ``evaluate_accuracy`` with ``HFRollout``; TRL's LoRA merged into its base
first) and the mean training reward of the last 10 steps; then the ratios of each pair, the last
line their median. microrl runs the recipe itself with evaluation only after the last step, no KL
metric, TensorBoard, plot, sample log or intermediate checkpoint.

The same on both sides, read from configs/grpo_lora.yaml: the warm-started base
outputs/base/tiny-adder (built by the recipe's ``prepare_base_model`` if missing), float32, one
torch thread; the addition prompts (TRL: 128 x steps of them from the recipe's prompt stream,
never eval prompts; plain text such as "12+7=", ``<bos>`` prepended by the tokenizer, left-padded)
and the reward (the task's exact-match ``score``); LoRA rank 8, alpha 16, dropout 0 on every
linear layer but the head (peft "all-linear"); AdamW (torch's, betas 0.9/0.999, eps 1e-8, no
weight decay), lr 2e-3 constant (TRL's default would decay it linearly), no warm-up, gradient
clip 1.0; sampling at temperature 1.0, top_k 0, top_p 1, 4 new tokens, a response ending at its
first ``<eos>`` (in the loss); 1024 rows per rollout, shuffled, 4 optimizer steps of 256 rows in
2 micro-batches of 128 (TRL: per_device_train_batch_size 128, gradient_accumulation_steps 2,
steps_per_generation 8); one pass (num_iterations 1); the clipped surrogate, clip 0.2/0.2, dual
clip at 3 (microrl's ``clip_ratio_c``, TRL's ``delta``); no KL (TRL beta 0: no reference model);
group advantages (s - mean) / std, unbiased std (TRL ``scale_rewards="group"``); no dropout, no
gradient checkpointing (TRL's default), no bf16 (TRL's default); ``actor.mask_truncated`` as
TRL's ``mask_truncated_completions``. DAPO's dynamic sampling and overlong penalty (no TRL
counterpart) must be off.

Not identical:
- Old log-probs. microrl runs with ``actor.policy_loss.bypass_mode=true``: the sampler's own
  log-probs are the ratio's anchor, no extra pass. TRL recomputes them here: with
  steps_per_generation (8 micro-steps) > gradient_accumulation_steps (2) its
  ``_generate_and_score_completions`` runs a no-grad forward over all 1024 rows after sampling.
  ``--recompute-old`` runs microrl without the bypass (its own old log-prob pass) to compare the
  same work.
- Loss normalisation. microrl's token-mean divides each optimizer step's summed token loss by
  that mini-batch's token count. TRL's ``loss_type="dapo"`` (chosen: one global denominator per
  accumulated batch) divides by the rollout's token count / 4, the mean over its 4 mini-batches;
  ``bnpo`` would instead average the 2 micro-batches' own token-means. With responses of 1-4
  tokens the two denominators differ by about 1%.
- Advantage floor: microrl divides by max(std, 1e-6), TRL by std + 1e-4 (both 0 for a group
  without spread).
- TRL's training forward also computes the per-token entropy (its fused head always does);
  microrl computes none with the bypass. TRL samples the whole rollout in one ``generate`` call
  as microrl does, with no log-prob recorder.
- Sampling and shuffling draw from different random streams, so the runs differ by RL noise.
- microrl evaluates the live LoRA model; TRL's adapter is merged first (the same function up to
  float rounding).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = "outputs/bench_trl"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
REWARD_WINDOW = 10  # the table's reward: mean over this many last steps


def _config() -> Any:
    from microrl.configs.examples import GRPOExampleConfig
    from microrl.configs.loader import load_config
    from microrl.run.cli import CONFIG_DIR

    return load_config(GRPOExampleConfig, CONFIG_DIR / "grpo_lora.yaml")


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _last_mean(values: list[float]) -> float:
    tail = values[-REWARD_WINDOW:]
    return sum(tail) / max(len(tail), 1)


# ----------------------------------------------------------------------------- microrl
def _load_recipe() -> Any:
    """The recipe examples/grpo_lora.py runs, whose names the timing below replaces."""
    return importlib.import_module("microrl.recipes.grpo")


def run_microrl(steps: int, out_dir: str, recompute_old: bool) -> dict[str, Any]:
    """The recipe in this process, its evaluations timed (and taken out of the RL time)."""
    from microrl.run import read_metrics

    recipe = _load_recipe()
    evals: list[tuple[float, float]] = []  # (seconds, accuracy) of each evaluation
    make_evaluator, finish = recipe.evaluator, recipe.finish
    captured: dict[str, float] = {}

    def timed_evaluator(*args: Any, **kwargs: Any) -> Any:
        evaluate = make_evaluator(*args, **kwargs)

        def timed() -> float:
            start = time.perf_counter()
            accuracy = evaluate()
            evals.append((time.perf_counter() - start, accuracy))
            return accuracy

        return timed

    def timed_finish(*args: Any, **kwargs: Any) -> int:
        captured.update(train_time=kwargs["train_time"], peak=peak_rss_mb())
        return finish(*args, **kwargs)

    recipe.evaluator, recipe.finish = timed_evaluator, timed_finish
    overrides = [
        f"train.steps={steps}",
        f"train.eval_every={steps}",  # only after the last step
        "train.kl_metric_every=0",
        f"actor.policy_loss.bypass_mode={'false' if recompute_old else 'true'}",
        "output.tensorboard=false",
        "output.plot=false",
        "output.progress=false",
        "output.log_samples_every=0",
        "output.save_every=0",
        f"output.dir={out_dir}",
    ]
    if recipe.main([*overrides, "--overwrite"]) != 0:
        raise RuntimeError("the recipe failed")
    rewards = [m["reward"] for m in read_metrics(Path(out_dir) / "metrics.jsonl") if "reward" in m]
    return {
        # the first evaluation is the starting accuracy, before the loop; the others ran inside it
        "rl_time": captured["train_time"] - sum(t for t, _ in evals[1:]),
        "peak_rss_mb": captured["peak"],
        "start_accuracy": evals[0][1],
        "accuracy": evals[-1][1],
        "reward": _last_mean(rewards),
        "steps": len(rewards),
    }


# ----------------------------------------------------------------------------- TRL
def trl_args(cfg: Any, steps: int, out_dir: str, *, device: str = "cpu") -> Any:
    """GRPOConfig with the recipe's layout and optimiser (module docstring), for ``steps``
    rollouts on ``device``: float32 on the CPU, bf16 autocast (``bf16=True``) on CUDA, as the
    engine's ``dtype=auto`` (benchmarks/bench_gpu_step.py uses it there)."""
    from trl import GRPOConfig

    actor, loss, optim = cfg.actor, cfg.actor.policy_loss, cfg.actor.optim
    rollout_rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    updates_per_rollout = rollout_rows // cfg.train.mini_batch_size
    if optim.schedule.value != "constant" or optim.warmup_steps or optim.name != "adamw":
        raise ValueError("the benchmark maps only AdamW with a constant lr and no warm-up")
    if actor.loss_agg_mode.value != "token-mean" or loss.name.value != "grpo":
        raise ValueError("the benchmark maps only the grpo surrogate with token-mean")
    # DAPO's knobs that TRL's GRPOTrainer has no counterpart for (mask_truncated has one).
    if getattr(cfg.rollout, "dynamic_sampling", False) or getattr(cfg.task, "overlong_buffer", 0):
        raise ValueError(
            "the benchmark needs rollout.dynamic_sampling and task.rewards.overlong_buffer off"
        )
    return GRPOConfig(
        output_dir=out_dir,
        max_steps=steps * updates_per_rollout,  # TRL counts optimizer steps
        per_device_train_batch_size=actor.micro_batch_size,
        gradient_accumulation_steps=cfg.train.mini_batch_size // actor.micro_batch_size,
        steps_per_generation=rollout_rows // actor.micro_batch_size,  # in micro-batches
        num_generations=cfg.rollout.group_size,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=actor.temperature,
        top_k=0,
        top_p=1.0,
        num_iterations=cfg.train.ppo_epochs,
        beta=loss.kl_coef,
        epsilon=loss.clip_ratio_low,
        epsilon_high=loss.clip_ratio_high,
        delta=loss.clip_ratio_c,
        loss_type="dapo",
        mask_truncated_completions=getattr(actor, "mask_truncated", False),
        scale_rewards="group",
        learning_rate=optim.lr,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_epsilon=optim.eps,
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.grad_clip or 0.0,
        optim="adamw_torch",  # torch.optim.AdamW, as the engine builds it
        lr_scheduler_type="constant",
        warmup_steps=0,
        gradient_checkpointing=actor.gradient_checkpointing,
        disable_dropout=actor.disable_dropout,
        bf16=device != "cpu",
        fp16=False,
        use_cpu=device == "cpu",
        seed=cfg.train.seed,
        shuffle_dataset=True,
        remove_unused_columns=False,  # the reward needs the "answer" column
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        logging_steps=updates_per_rollout,  # one log line per rollout, as metrics.jsonl has
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def step_timer() -> Any:
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time from the start of training to the end of the last optimizer step."""

        def __init__(self) -> None:
            self.start = self.end = 0.0
            self.optimizer_steps = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.optimizer_steps += 1
            self.end = time.perf_counter()

    return StepTimer()


def run_trl(steps: int, out_dir: str) -> dict[str, Any]:
    import peft
    import torch
    from datasets import Dataset
    from trl import GRPOTrainer

    from microrl.rollout import HFRollout
    from microrl.run import Dist, evaluate_accuracy
    from microrl.run.dist import train_threads
    from microrl.run.toy_model import load_pretrained
    from microrl.tasks import Problem, make_task

    cfg = _config()
    if threads := train_threads(cfg):
        torch.set_num_threads(threads)
    tokenizer, model = load_pretrained(cfg.model.path)
    task = make_task(cfg.task, tokenizer)
    # The recipe's prompt stream (rank 0), never the held-out prompts.
    problems = task.sample(
        random.Random(cfg.train.seed * 1000), cfg.rollout.prompts_per_step * steps
    )
    dataset = Dataset.from_dict(
        {"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]}
    )
    rollout_sizes: list[int] = []

    def exact_match(
        prompts: list[str], completions: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        rollout_sizes.append(len(completions))
        return task.score(
            completions, [Problem(p, a) for p, a in zip(prompts, answer, strict=True)]
        )

    lora = cfg.actor.lora
    timer = step_timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=trl_args(cfg, steps, out_dir),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules or "all-linear",
            bias="none",
        ),
        callbacks=[timer],
    )
    trainer.train()
    rows, updates = trainer.args.generation_batch_size, timer.optimizer_steps
    if rollout_sizes != [rows] * steps or updates != trainer.args.max_steps:
        raise RuntimeError(f"{updates} updates over rollouts of {rollout_sizes} rows")
    merged = trainer.model.merge_and_unload().eval()
    sampler = HFRollout(merged, tokenizer)
    problems = task.eval_problems()
    accuracy = evaluate_accuracy(sampler, task, problems, Dist(), cfg.rollout.max_new_tokens)
    peak = peak_rss_mb()  # after an evaluation, as microrl's
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return {
        "rl_time": timer.end - timer.start,
        "peak_rss_mb": peak,
        "accuracy": accuracy,
        "reward": _last_mean(rewards),
        "steps": len(rollout_sizes),
        "optimizer_steps_per_rollout": timer.optimizer_steps / len(rollout_sizes),
        "rows_per_rollout": rollout_sizes[0],
        "torch_threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------- driver
def ensure_base_model() -> None:
    """Build and warm-start the base model as the recipe does, when it is missing."""
    import torch

    from microrl.run import Dist, prepare_base_model
    from microrl.run.dist import train_threads

    cfg = _config()
    if threads := train_threads(cfg):
        torch.set_num_threads(threads)
    prepare_base_model(cfg.model, cfg.task, Dist(), cfg.rollout.max_new_tokens)


def run_worker(side: str, args: argparse.Namespace, pair: int) -> dict[str, Any]:
    python = args.microrl_python if side == "microrl" else args.trl_python
    out_dir = f"{OUT}/{side}-{pair}"
    result = ROOT / OUT / f"{side}-{pair}.json"
    command = [python, str(Path(__file__).resolve()), "--worker", side, "--steps", str(args.steps)]
    command += ["--out-dir", out_dir, "--result", str(result)]
    if args.recompute_old:
        command.append("--recompute-old")
    return run_process(command, ROOT / OUT / f"{side}-{pair}.log", result, f"{side} run {pair}")


def run_process(command: list[str], log: Path, result: Path, name: str) -> dict[str, Any]:
    """``command`` in a fresh offline process from the repository root, its output in ``log``;
    the JSON it wrote to ``result``. A failure raises with the log's last lines."""
    with log.open("w") as f:
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, **OFFLINE}, stdout=f, stderr=f)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{name} failed (exit {done.returncode}), {log}:\n{tail}")
    return json.loads(result.read_text())


def _run_line(side: str, pair: int, r: dict[str, Any], steps: int) -> str:
    line = (
        f"{side:7s} run {pair}: {r['rl_time']:.1f}s RL ({r['rl_time'] / steps:.3f} s/step), "
        f"peak RSS {r['peak_rss_mb']:.0f} MB, accuracy {r['accuracy']:.3f}"
    )
    if side == "trl":  # checked by the worker: the recipe's layout
        updates, rows = r["optimizer_steps_per_rollout"], r["rows_per_rollout"]
        line += f", {updates:.0f} optimizer steps per rollout of {rows} rows"
    return line


def print_table(runs: list[tuple[str, int, dict[str, Any]]], steps: int) -> None:
    print("\n| run | side | RL time (s) | s/step | peak RSS (MB) | held-out accuracy | reward |")
    print("|---|---|---|---|---|---|---|")
    for side, pair, r in runs:
        print(
            f"| {pair} | {side} | {r['rl_time']:.1f} | {r['rl_time'] / steps:.3f} | "
            f"{r['peak_rss_mb']:.0f} | {r['accuracy']:.3f} | {r['reward']:.3f} |"
        )
    print(f"\nreward: mean training reward of the last {REWARD_WINDOW} steps\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="RL steps (rollouts) per run")
    parser.add_argument("--pairs", type=int, default=3, help="(microrl, TRL) pairs of runs")
    parser.add_argument("--trl-python", default=str(ROOT.parent / "trlenv" / "bin" / "python"))
    parser.add_argument("--microrl-python", default=sys.executable)
    parser.add_argument(
        "--recompute-old",
        action="store_true",
        help="microrl recomputes the old log-probs (bypass_mode=false), as TRL does here",
    )
    parser.add_argument("--worker", choices=("microrl", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(ROOT)  # the config's paths (model.path) are relative to the repository

    if args.worker:
        if args.worker == "microrl":
            result = run_microrl(args.steps, args.out_dir, args.recompute_old)
        else:
            result = run_trl(args.steps, args.out_dir)
        Path(args.result).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return

    (ROOT / OUT).mkdir(parents=True, exist_ok=True)
    ensure_base_model()
    runs: list[tuple[str, int, dict[str, Any]]] = []
    for pair in range(1, args.pairs + 1):
        for side in ("microrl", "trl"):
            r = run_worker(side, args, pair)
            runs.append((side, pair, r))
            print(_run_line(side, pair, r, args.steps), flush=True)
    first = next(r for side, _, r in runs if side == "microrl")
    print(f"held-out accuracy of the base model: {first['start_accuracy']:.3f}")
    print_table(runs, args.steps)
    ratios = []
    for pair in range(1, args.pairs + 1):
        mine, theirs = (r for _, p, r in runs if p == pair)
        ratios.append(mine["rl_time"] / theirs["rl_time"])
        memory = mine["peak_rss_mb"] / theirs["peak_rss_mb"]
        print(f"pair {pair}: rl time ratio {ratios[-1]:.2f}, peak RSS ratio {memory:.2f}")
    print(f"rl time ratio microrl/trl: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
