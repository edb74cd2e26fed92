"""The scaffolding every RL recipe shares around its step: evaluation, tracking, shutdown.

The algorithm itself (sample, score, old/ref log-probs, advantages, update) stays in each recipe
so it reads top to bottom; what is here is the same for GRPO and PPO.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from microrl.configs.loader import config_to_yaml
from microrl.engine.checkpoint.export import export_peft_adapter
from microrl.engine.rollout import RolloutBackend, SamplingParams
from microrl.run.checkpoint import save_run
from microrl.run.dist import Dist
from microrl.run.tracking import Tracker
from microrl.tasks import Problem, Task

__all__ = ["evaluate_accuracy", "evaluator", "finish", "start_tracking"]


def evaluate_accuracy(
    rollout: RolloutBackend,
    task: Task,
    problems: Sequence[Problem],
    dist_info: Dist,
    max_new_tokens: int,
) -> float:
    """Greedy accuracy (reward >= ``task.solved_threshold``) over every rank's share of
    ``problems``, summed over ranks."""
    greedy = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    result = rollout.generate([p.prompt for p in problems], greedy)
    scores = task.score(result.texts, problems)
    solved = sum(1.0 for s in scores if s >= task.solved_threshold)
    correct, total = dist_info.sum([solved, len(problems)])
    return correct / max(total, 1.0)


def evaluator(
    rollout: RolloutBackend, task: Task, dist_info: Dist, max_new_tokens: int
) -> Callable[[], float]:
    """Greedy held-out accuracy of the policy, each rank scoring its share of the problems."""
    problems = dist_info.shard(task.eval_problems())
    return lambda: evaluate_accuracy(rollout, task, problems, dist_info, max_new_tokens)


def start_tracking(
    cfg: Any, dist_info: Dist, start_step: int, evaluate: Callable[[], float], t_setup: float
) -> tuple[Tracker, float]:
    """Open the tracker (rank 0 writes), save the config, and measure the starting accuracy."""
    tracker = Tracker(
        cfg.output.dir,
        total_steps=cfg.train.steps,
        start_step=start_step,
        enabled=dist_info.is_main,
        tensorboard=cfg.output.tensorboard,
        progress=cfg.output.progress,
        log_every=cfg.output.log_every,
    )
    if dist_info.is_main:
        (tracker.out_dir / "config.yaml").write_text(config_to_yaml(cfg))
    accuracy = evaluate()
    tracker.write(
        f"held-out greedy accuracy at step {start_step}: {accuracy:.3f} "
        f"(setup {time.perf_counter() - t_setup:.0f}s)"
    )
    if start_step == 0:
        tracker.log(0, {"eval/accuracy": accuracy})
    return tracker, accuracy


def finish(
    cfg: Any,
    engines: Mapping[str, Any],
    tracker: Tracker,
    *,
    step: int,
    start_step: int,
    rng: random.Random,
    dist_info: Dist,
    interrupted: bool,
    first_accuracy: float,
    last_metrics: Mapping[str, float],
    train_time: float,
) -> int:
    """Checkpoint; then either stop for ``--resume`` (exit code 130) or export the actor's LoRA
    adapter, plot, and print the summary (exit code 0)."""
    log = print if dist_info.is_main else (lambda *_: None)
    path = save_run(cfg.output.dir, engines, step=step, rng=rng, dist_info=dist_info, config=cfg)
    if interrupted:
        tracker.close(plot=cfg.output.plot)
        log(f"\ninterrupted after step {step}: checkpoint in {path}; continue with --resume")
        dist_info.close()
        return 130
    actor = engines["actor"]
    export_peft_adapter(actor.module, f"{cfg.output.dir}/adapter", peft_model=actor.peft_model)
    final_accuracy = last_metrics.get("eval/accuracy", first_accuracy)
    plot = tracker.close(plot=cfg.output.plot)
    log(
        f"\nheld-out greedy accuracy: {first_accuracy:.3f} (step {start_step}) -> "
        f"{final_accuracy:.3f} (step {step}) in {train_time:.0f}s of RL\n"
        f"outputs in {cfg.output.dir}/: metrics.jsonl, tensorboard/, "
        f"{plot.name if plot else 'no plot'}, adapter/ (the actor's LoRA adapter, PEFT format), "
        "checkpoint/ (--resume)"
    )
    dist_info.close()
    return 0
