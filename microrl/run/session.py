"""The scaffolding both examples share around their RL step: evaluation, tracking, shutdown.

The algorithm itself (sample, score, old/ref log-probs, advantages, update) stays in each example
so it reads top to bottom; what is here is the same for GRPO and PPO.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from common.rollout import Rollout, evaluate_accuracy, generate
from common.runtime import Dist, save_run
from common.task import AdditionTask, Problem
from common.tracking import Tracker
from microrl.configs.loader import config_to_yaml
from microrl.engine import ActorEngine
from microrl.engine.distributed import gathered
from microrl.engine.export import export_peft_adapter


def sample(
    actor: ActorEngine, tokenizer: PreTrainedTokenizerBase, problems: list[Problem], cfg: Any
) -> Rollout:
    """A group of ``cfg.rollout.group_size`` responses per prompt from the current policy, at the
    loss's temperature (under FSDP the full weights are gathered for ``generate``).

    Each rank calls it with its *own* prompts, so the rows of one prompt (a GRPO group) are all
    on the rank that sampled them: group statistics computed per rank are those of the whole
    rollout. Shard prompts over ranks, never the rows of a rollout (see :func:`check_whole_groups`).
    """
    with gathered(actor.module):
        return generate(
            actor.model,
            tokenizer,
            [p.prompt for p in problems],
            num_samples=cfg.rollout.group_size,
            temperature=cfg.actor.temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )


def check_whole_groups(group_ids: torch.Tensor, group_size: int) -> None:
    """Raise ``ValueError`` unless every group in ``group_ids [B]`` has exactly ``group_size`` rows
    on this rank.

    ``grpo_advantages`` sees only this rank's rows, so its group mean and std are the true ones
    only when no group spans ranks. The examples guarantee that by sharding prompts (each rank
    samples all ``group_size`` responses of its prompts); a group split over ranks, or cut short,
    leaves fewer rows here, which this local check (no collective) catches.
    """
    ids, counts = torch.unique(group_ids, return_counts=True)
    bad = (counts != group_size).nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(f"group {ids[i].item()} has {counts[i].item()}" for i in bad[:3])
        raise ValueError(
            "GRPO groups must not span ranks: every group needs all its "
            f"rollout.group_size={group_size} rows on one rank, but here {shown} "
            "(shard prompts over ranks, never the rows of a rollout)"
        )


def evaluator(
    actor: ActorEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    dist_info: Dist,
    max_new_tokens: int,
) -> Callable[[], float]:
    """Greedy held-out accuracy of the policy, each rank scoring its share of the problems."""
    problems = dist_info.shard(task.eval_problems())

    def evaluate() -> float:
        with gathered(actor.module):  # FSDP: full weights for generate; a no-op in one process
            return evaluate_accuracy(
                actor.model, tokenizer, task, problems, dist_info, max_new_tokens
            )

    return evaluate


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
