"""The scaffolding every RL recipe shares around its step: evaluation, tracking, shutdown.

The algorithm itself (sample, score, old/ref log-probs, advantages, update) stays in each recipe
so it reads top to bottom; what is here is the same for GRPO and PPO.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from microrl.configs.loader import config_to_yaml
from microrl.configs.run import RolloutConfig
from microrl.engine.checkpoint.export import export_merged_model, export_peft_adapter
from microrl.rollout import (
    HFRollout,
    Rollout,
    RolloutBackend,
    SamplingParams,
    make_rollout_backend,
)
from microrl.rollout.episodes import EpisodeError
from microrl.run.async_start import resumed_rollouts, start_prefetcher, warn_if_uncorrected
from microrl.run.checkpoint import VLLM_SERVER_LOGS, save_run
from microrl.run.dist import Dist, train_threads
from microrl.run.prefetcher import RolloutPrefetcher
from microrl.run.sampling import episode_rows, sample_and_score
from microrl.run.tracking import Tracker
from microrl.tasks import Problem, RewardError, Task

__all__ = [
    "evaluate_accuracy",
    "evaluator",
    "finish",
    "sample_rows",
    "start_sampling",
    "start_tracking",
]


def start_sampling(
    cfg: Any,
    engine: Any,
    tokenizer: Any,
    task: Task,
    params: SamplingParams,
    rng: random.Random,
    prompts_per_step: int,
    *,
    start_step: int,
    restored: Mapping[str, Any],
    dist_info: Dist,
    scorer: Callable[[Any], None] | None = None,
    scorer_collective: bool = False,
    image_encoder: Any = None,
) -> tuple[RolloutBackend, RolloutPrefetcher | None]:
    """The recipe's samplers for its ``rollout`` section: ``(sampler, prefetch)``.

    ``rollout.max_staleness=0``: the ``rollout.backend`` sampler (it samples every step's
    rollout and evaluates) and None. ``k > 0``: an ``HFRollout`` of the trainer's current
    weights (it evaluates) and a :class:`~microrl.run.RolloutPrefetcher` whose worker samples the
    steps ahead with ``engine``'s pushed weights, drawing the prompts from ``rng``
    (``prompts_per_step`` each, this rank's share, up to ``train.steps``), holding first the
    rollouts a resumed checkpoint carried (``restored``: :func:`~microrl.run.load_run`'s
    ``extra_state``); rank 0 warns once when ``actor.policy_loss`` sets no behaviour-policy
    correction. A checkpoint holding rollouts sampled ahead, resumed with a smaller
    ``max_staleness``, is a ``ValueError``. ``cfg``: a recipe config (its ``rollout``,
    ``task.name``, ``train.steps``, ``train.num_threads`` and ``actor.policy_loss``).
    ``scorer``, ``scorer_collective``: the prefetcher's producer-side scoring (a
    teacher's log-probs; :class:`~microrl.run.RolloutPrefetcher`). ``image_encoder``: a
    vision-language policy's (:attr:`~microrl.run.RunStart.image_encoder`), for the sampler."""
    k = cfg.rollout.max_staleness
    ahead = resumed_rollouts(restored, k)  # a checkpoint's, if any
    if not k:
        sampler = make_rollout_backend(
            cfg.rollout.backend,
            engine,
            tokenizer,
            vllm=cfg.rollout.vllm,
            sync_check_tol=cfg.rollout.sync_check_tol,
            image_encoder=image_encoder,
        )
        return sampler, None
    prefetch = start_prefetcher(
        engine,
        tokenizer,
        task,
        params,
        rng,
        prompts_per_step,
        rollout=cfg.rollout,
        task_name=cfg.task.name,
        last_step=cfg.train.steps,
        start_step=start_step,
        num_threads=train_threads(cfg),
        state=ahead,
        log_dir=str(Path(cfg.output.dir) / VLLM_SERVER_LOGS),
        scorer=scorer,
        scorer_collective=scorer_collective,
        image_encoder=image_encoder,
    )
    if dist_info.is_main:  # once: k > 0 without a behaviour-policy correction
        warn_if_uncorrected(cfg.actor.policy_loss, k)
    return HFRollout(engine, tokenizer, image_encoder=image_encoder), prefetch


def evaluate_accuracy(
    rollout: RolloutBackend,
    task: Task,
    problems: Sequence[Problem],
    dist_info: Dist,
    max_new_tokens: int,
    limits: RolloutConfig | None = None,
) -> float:
    """Greedy accuracy (reward >= ``task.solved_threshold``) over every rank's share of
    ``problems``, summed over ranks; a multi-turn task's greedy episodes are played under
    ``limits`` (a row whose environment raised, with ``rollout.skip_env_errors``, is unsolved)."""
    greedy = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    sampled, scores = sample_and_score(rollout, task, problems, greedy, limits)
    episodes = episode_rows(sampled)  # an agent's branches: one episode, counted once
    if episodes is not None:
        scores = scores[episodes[1]]
    solved = float((scores >= task.solved_threshold).sum())
    correct, total = dist_info.sum([solved, len(problems)])
    return correct / max(total, 1.0)


def evaluator(
    rollout: RolloutBackend,
    task: Task,
    dist_info: Dist,
    max_new_tokens: int,
    limits: RolloutConfig | None = None,
) -> Callable[[], float]:
    """Greedy held-out accuracy of the policy, each rank scoring its share of the problems."""
    problems = dist_info.shard(task.eval_problems())
    return lambda: evaluate_accuracy(rollout, task, problems, dist_info, max_new_tokens, limits)


def start_tracking(
    cfg: Any, dist_info: Dist, start_step: int, evaluate: Callable[[], float], t_setup: float
) -> tuple[Tracker, float]:
    """Open the tracker and its experiment trackers (rank 0 writes), save the config, and
    measure the starting accuracy.

    An environment's or a reward's error in that evaluation keeps its type and names it
    (``evaluation at step 0: ...``): it runs before the step loop, which names the steps after."""
    config_text = config_to_yaml(cfg)
    tracker = Tracker(
        cfg.output.dir,
        total_steps=cfg.train.steps,
        start_step=start_step,
        enabled=dist_info.is_main,
        trackers=cfg.output.trackers,
        tensorboard=cfg.output.tensorboard,
        config=yaml.safe_load(config_text),
        project=cfg.output.project,
        progress=cfg.output.progress,
        log_every=cfg.output.log_every,
        samples_every=cfg.output.log_samples_every,
        samples_per_step=cfg.output.log_samples,
    )
    if dist_info.is_main:
        (tracker.out_dir / "config.yaml").write_text(config_text)
    try:
        accuracy = evaluate()
    except (EpisodeError, RewardError) as err:
        raise type(err)(f"evaluation at step {start_step}: {err}") from err
    tracker.write(
        f"held-out greedy accuracy at step {start_step}: {accuracy:.3f} "
        f"(setup {time.perf_counter() - t_setup:.0f}s)"
    )
    if start_step == 0:
        tracker.log(0, {"eval/accuracy": accuracy})
    return tracker, accuracy


def sample_rows(
    rollout: Rollout,
    problems: Sequence[Problem],
    scores: Sequence[float],
    tokenizer: Any = None,
) -> Iterator[dict[str, Any]]:
    """The rows of ``rollout`` in the order :meth:`Tracker.log_samples` shows them: the first
    response of each prompt, prompts in sampling order, then the second of each, and so on; a
    row is ``{"group", "reward", "prompt", "response"}`` (``group``: the prompt's index in
    ``problems``, this rank's). Lazy: nothing is computed on a step that logs no samples.

    ``prompt`` is what the model saw: a single-turn row's problem prompt; a multi-turn row's
    first input as the environment's ``init`` gave it and the chat template rendered it (decoded
    by ``tokenizer``, needed then, with its special tokens, as the trajectory in ``response``).
    """
    episodes = rollout.num_turns is not None
    if episodes and tokenizer is None:
        raise ValueError(
            "sample_rows of a multi-turn rollout needs the tokenizer: the prompt shown is the "
            "environment's first input as the model saw it (sample_rows(..., tokenizer))"
        )
    return _sample_rows(rollout, problems, scores, tokenizer if episodes else None)


def _sample_rows(
    rollout: Rollout, problems: Sequence[Problem], scores: Sequence[float], tokenizer: Any
) -> Iterator[dict[str, Any]]:
    group_ids = rollout.group_ids.tolist()
    nth, seen = [], {}  # nth[i]: row i is its prompt's nth response
    for group in group_ids:
        nth.append(seen.get(group, 0))
        seen[group] = nth[-1] + 1
    for i in sorted(range(len(group_ids)), key=lambda i: (nth[i], group_ids[i])):
        group = group_ids[i]
        prompt = (
            problems[group].prompt if tokenizer is None else _seen_prompt(rollout, i, tokenizer)
        )
        yield {
            "group": group,
            "reward": float(scores[i]),
            "prompt": prompt,
            "response": rollout.texts[i],
        }


def _seen_prompt(rollout: Rollout, row: int, tokenizer: Any) -> str:
    """Row ``row``'s prompt tokens decoded with their special tokens: the attended columns before
    the first response column (the rollout layout, ``[left-padded prompt | response]``)."""
    batch = rollout.batch
    response_cols = batch["loss_mask"].bool().any(dim=0).nonzero()
    width = batch["input_ids"].shape[1]
    boundary = int(response_cols[0]) if response_cols.numel() else width
    attended = batch["attention_mask"][row, :boundary].bool()
    ids = batch["input_ids"][row, :boundary][attended]
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


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
    tokenizer: Any = None,
    extra_state: Mapping[str, Any] | None = None,
) -> int:
    """Checkpoint (with ``extra_state``: :func:`~microrl.run.checkpoint.save_run`); then either
    stop for ``--resume`` (exit code 130) or export the actor's LoRA adapter (and with
    ``output.export_merged`` the merged model, ``tokenizer`` beside it) or, in a full fine-tune,
    the trained model, plot, and print the summary (exit code 0)."""
    log = print if dist_info.is_main else (lambda *_: None)
    path = save_run(
        cfg.output.dir,
        engines,
        step=step,
        rng=rng,
        dist_info=dist_info,
        config=cfg,
        extra_state=extra_state,
    )
    if interrupted:
        tracker.close(plot=cfg.output.plot)
        log(f"\ninterrupted after step {step}: checkpoint in {path}; continue with --resume")
        dist_info.close()
        return 130
    actor = engines["actor"]
    # Every rank takes part in gathering the weights.
    merge = cfg.output.export_merged and actor.peft_model is not None
    if actor.peft_model is None:  # a full fine-tune: the trained model itself
        export_merged_model(actor.module, f"{cfg.output.dir}/model", tokenizer=tokenizer)
        trained = "model/ (the trained model, transformers format), "
    else:
        export_peft_adapter(actor.module, f"{cfg.output.dir}/adapter", peft_model=actor.peft_model)
        trained = "adapter/ (the actor's LoRA adapter, PEFT format), "
    if merge:
        export_merged_model(actor.module, f"{cfg.output.dir}/merged", tokenizer=tokenizer)
        trained += "merged/ (LoRA merged in, transformers format), "
    final_accuracy = last_metrics.get("eval/accuracy", first_accuracy)
    plot = tracker.close(plot=cfg.output.plot)
    tracked = "".join(f"{where}, " for where in tracker.locations)
    samples = "samples.jsonl, " if tracker.samples_path.is_file() else ""
    log(
        f"\nheld-out greedy accuracy: {first_accuracy:.3f} (step {start_step}) -> "
        f"{final_accuracy:.3f} (step {step}) in {train_time:.0f}s of RL\n"
        f"outputs in {cfg.output.dir}/: metrics.jsonl, {samples}{tracked}"
        f"{plot.name if plot else 'no plot'}, {trained}checkpoint/ (--resume)"
    )
    dist_info.close()
    return 0
