"""The scaffolding every RL recipe shares around its step: rollouts, evaluation, tracking,
shutdown (the algorithm itself stays in each recipe, so it reads top to bottom)."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from microrl.agents.agent_sampler import AgentSampler
from microrl.configs.loader import config_to_yaml
from microrl.configs.run import RolloutConfig
from microrl.engine.checkpoint.export import export_merged_model, export_peft_adapter
from microrl.rollout import (
    HFRollout,
    InProcessSampler,
    Rollout,
    RolloutBackend,
    SamplingParams,
    make_sampler,
    turn_terminators,
)
from microrl.rollout.episodes import EpisodeError
from microrl.run.checkpoint import VLLM_SERVER_LOGS, save_run
from microrl.run.dist import Dist, train_threads
from microrl.run.distill import teacher_scoring
from microrl.run.sampling import agent_limits, episode_rows, sample_and_score
from microrl.run.source import ROLLOUT_BUFFER_KEY, RolloutSource
from microrl.run.tracking import Tracker
from microrl.tasks import Problem, RewardError, Task, is_agent_task, is_episode_task

__all__ = [
    "CORRECTIONS",
    "close_on_exit",
    "evaluate_accuracy",
    "evaluator",
    "finish",
    "sample_rows",
    "scores_ahead",
    "start_rollouts",
    "start_tracking",
    "warn_if_uncorrected",
]

logger = logging.getLogger(__name__)

#: The policy-loss keys that correct for the behaviour policy (docs/async.md).
CORRECTIONS = ("tis_cap", "token_ratio_band", "seq_ratio_band", "decoupled_is_cap")


def start_rollouts(
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
    image_encoder: Any = None,
    shaping: Callable[[Rollout], Any] | None = None,
    teacher: Any = None,
) -> tuple[RolloutSource, Callable[[], RolloutBackend] | RolloutBackend]:
    """The recipe's rollouts, for every ``rollout.max_staleness``: ``(source, policy)``.

    ``source``: a :class:`~microrl.run.RolloutSource` over :func:`~microrl.rollout.make_sampler`'s
    sampler at version ``start_step``, the rounds of ``restored`` (``extra_state``) first.
    ``policy``: what evaluation samples, the trainer's current weights."""
    k = cfg.rollout.max_staleness
    env_maker = task.make_env if is_episode_task(task) else None
    try:
        sampler = make_sampler(
            engine,
            tokenizer,
            cfg.rollout,
            version=start_step,
            env_maker=env_maker,
            num_threads=train_threads(cfg),
            log_dir=str(Path(cfg.output.dir) / VLLM_SERVER_LOGS),
            image_encoder=image_encoder,
        )
    except Exception as err:
        if env_maker is None or k == 0 or cfg.rollout.backend != "hf":
            raise
        raise ValueError(
            f"task.name={cfg.task.name} with rollout.max_staleness={k}: the environments must "
            f"be built in the rollout worker process, which failed: {err}"
        ) from err
    if isinstance(sampler, InProcessSampler):
        policy, lag = sampler.current, sampler.max_lag
    else:
        policy, lag = HFRollout(engine, tokenizer, image_encoder=image_encoder), 0
    if is_agent_task(task):  # the agents play on the sampler's jobs
        config = getattr(getattr(engine, "model", None), "generation_config", None)
        stops = turn_terminators(tokenizer, config, require_template=False)
        limits = agent_limits(task, cfg.rollout)
        sampler = AgentSampler(sampler, tokenizer, task, limits, stop_ids=stops)
    scoring = teacher_scoring(teacher, dist_info)
    try:
        source = RolloutSource(
            sampler,
            task,
            params,
            rng,
            prompts_per_step,
            max_staleness=max(k, lag),
            last_step=cfg.train.steps,
            dist_info=dist_info,
            limits=cfg.rollout,
            state=restored.get(ROLLOUT_BUFFER_KEY),
            pad_token_id=tokenizer.pad_token_id,
            score_ahead=scores_ahead(task, sampler, **scoring),
            scorer=scoring.get("scorer"),
            shaping=shaping,
        )
    except BaseException:
        sampler.close()
        raise
    if dist_info.is_main:  # once: k > 0 without a behaviour-policy correction
        warn_if_uncorrected(cfg.actor.policy_loss, k)
    return source, policy


def scores_ahead(
    task: Task, sampler: Any, scorer: Callable | None = None, *, scorer_collective: bool = False
) -> bool:
    """Whether a round is scored in a background thread as soon as it is sampled: a
    model-based reward or a ``scorer``, unless anything there is a collective or runs on the
    trainer's thread (every rank must stay in step)."""
    reward = getattr(task, "reward", None)
    if sampler.trainer_thread or scorer_collective or getattr(reward, "collective", False):
        return False
    return bool(getattr(reward, "model_based", False)) or scorer is not None


def warn_if_uncorrected(policy_loss: Any, max_staleness: int) -> bool:
    """Warn when ``max_staleness > 0`` trains without a behaviour-policy correction; True if it did."""
    if max_staleness < 1 or any(getattr(policy_loss, key, None) is not None for key in CORRECTIONS):
        return False
    logger.warning(
        "rollout.max_staleness=%d trains on rollouts up to %d policy versions old without a "
        "behaviour-policy correction; the policy loss offers actor.policy_loss.decoupled_is_cap "
        "(AReaL's decoupled objective), tis_cap (truncated IS), token_ratio_band (IcePop) and "
        "seq_ratio_band (sequence masking), docs/async.md",
        max_staleness,
        max_staleness,
    )
    return True


@contextlib.contextmanager
def close_on_exit(*closables: Any) -> Iterator[None]:
    """Close each of ``closables`` that is not None when the block exits, also on an error."""
    try:
        yield
    finally:
        for closable in closables:
            if closable is not None:
                closable.close()


def evaluate_accuracy(
    rollout: RolloutBackend,
    task: Task,
    problems: Sequence[Problem],
    dist_info: Dist,
    max_new_tokens: int,
    limits: RolloutConfig | None = None,
) -> float:
    """Greedy accuracy (reward >= ``task.solved_threshold``) over every rank's share of ``problems``."""
    greedy = SamplingParams(greedy=True, max_new_tokens=max_new_tokens)
    sampled, scores = sample_and_score(rollout, task, problems, greedy, limits)
    episodes = episode_rows(sampled)  # an agent's branches: one episode, counted once
    if episodes is not None:
        scores = scores[episodes[1]]
    solved = float((scores >= task.solved_threshold).sum())
    correct, total = dist_info.sum([solved, len(problems)])
    return correct / max(total, 1.0)


def evaluator(
    policy: RolloutBackend | Callable[[], RolloutBackend],
    task: Task,
    dist_info: Dist,
    max_new_tokens: int,
    limits: RolloutConfig | None = None,
) -> Callable[[], float]:
    """Greedy held-out accuracy; ``policy``: a rollout backend, or what returns one each time."""
    problems = dist_info.shard(task.eval_problems())
    current = policy if not isinstance(policy, RolloutBackend) else (lambda: policy)
    return lambda: evaluate_accuracy(current(), task, problems, dist_info, max_new_tokens, limits)


def start_tracking(
    cfg: Any, dist_info: Dist, start_step: int, evaluate: Callable[[], float], t_setup: float
) -> tuple[Tracker, float]:
    """Open the tracker (rank 0 writes), save the config, and measure the starting accuracy
    (an environment's or reward's error there is named ``evaluation at step N: ...``)."""
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
    """The rows of ``rollout`` as :meth:`Tracker.log_samples` shows them (each prompt's first
    response, then each one's second, ...): ``{"group", "reward", "prompt", "response"}``, lazily;
    a multi-turn row's ``prompt`` is its first input as the model saw it (needs ``tokenizer``).
    """
    episodes = rollout.num_turns is not None
    if episodes and tokenizer is None:
        raise ValueError(
            "sample_rows of a multi-turn rollout needs the tokenizer: the prompt shown is the "
            "environment's first input as the model saw it (sample_rows(..., tokenizer))"
        )
    group_ids = rollout.group_ids.tolist()
    nth, seen = [], {}  # nth[i]: row i is its prompt's nth response
    for group in group_ids:
        nth.append(seen.get(group, 0))
        seen[group] = nth[-1] + 1
    return (
        {
            "group": group_ids[i],
            "reward": float(scores[i]),
            "prompt": _seen_prompt(rollout, i, tokenizer)
            if episodes
            else problems[group_ids[i]].prompt,
            "response": rollout.texts[i],
        }
        for i in sorted(range(len(group_ids)), key=lambda i: (nth[i], group_ids[i]))
    )


def _seen_prompt(rollout: Rollout, row: int, tokenizer: Any) -> str:
    """Row ``row``'s attended prompt tokens (before the first response column), decoded."""
    batch = rollout.batch
    response_cols = batch["loss_mask"].bool().any(dim=0).nonzero()
    boundary = int(response_cols[0]) if response_cols.numel() else batch["input_ids"].shape[1]
    attended = batch["attention_mask"][row, :boundary].bool()
    ids = batch["input_ids"][row, :boundary][attended]
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def save_checkpoint(
    cfg: Any,
    engines: Mapping[str, Any],
    step: int,
    *,
    rng: random.Random,
    dist_info: Dist,
    extra_state: Mapping[str, Any] | None = None,
) -> Path:
    """:func:`~microrl.run.checkpoint.save_run` of a recipe config (``output.dir``)."""
    return save_run(
        cfg.output.dir,
        engines,
        step=step,
        rng=rng,
        dist_info=dist_info,
        config=cfg,
        extra_state=extra_state,
    )


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
    """Checkpoint; then stop for ``--resume`` (exit code 130), or export the adapter (and the
    merged model) or the fully fine-tuned model, plot, and print the summary (exit code 0)."""
    log = print if dist_info.is_main else (lambda *_: None)
    path = save_checkpoint(
        cfg, engines, step, rng=rng, dist_info=dist_info, extra_state=extra_state
    )
    if interrupted:
        tracker.close(plot=cfg.output.plot)
        log(f"\ninterrupted after step {step}: checkpoint in {path}; continue with --resume")
        dist_info.close()
        return 130
    actor = engines["actor"]  # every rank takes part in gathering the weights
    if actor.peft_model is None:  # a full fine-tune: the trained model itself
        export_merged_model(actor.module, f"{cfg.output.dir}/model", tokenizer=tokenizer)
        trained = "model/ (the trained model, transformers format), "
    else:
        export_peft_adapter(actor.module, f"{cfg.output.dir}/adapter", peft_model=actor.peft_model)
        trained = "adapter/ (the actor's LoRA adapter, PEFT format), "
    if cfg.output.export_merged and actor.peft_model is not None:
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
