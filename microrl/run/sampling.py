"""One call for a recipe's rollout: sample (or play episodes) and score, for every kind of task.

A single-turn task is sampled with :meth:`~microrl.engine.rollout.RolloutBackend.generate` and
scored by its reward; a multi-turn task (one with ``make_env``,
:mod:`microrl.tasks.environments`) is played with
:meth:`~microrl.engine.rollout.RolloutBackend.run_episodes` under the ``rollout.max_turns``,
``rollout.max_episode_tokens`` and ``rollout.skip_env_errors`` limits and scored by its
environments' summed rewards. Training steps and the greedy evaluation go through the same call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from microrl.configs.run import RolloutConfig
from microrl.engine.rollout import Rollout, RolloutBackend, SamplingParams, select_groups
from microrl.run.dist import Dist
from microrl.tasks import Problem, Task, is_episode_task

__all__ = [
    "episode_metrics",
    "reward_metrics",
    "sample_and_score",
    "score_rollout",
    "whole_groups",
]


def sample_and_score(
    sampler: RolloutBackend,
    task: Task,
    problems: Sequence[Problem],
    params: SamplingParams,
    limits: RolloutConfig | None = None,
) -> tuple[Rollout, torch.Tensor]:
    """The rollout of ``params.num_samples`` rows per problem and each row's reward ``[B]``.

    ``limits``: the episode limits of a multi-turn task (``RolloutConfig``'s defaults if None).
    Row ``i`` answers ``problems[rollout.group_ids[i]]``; with ``rollout.skip_env_errors`` the
    rows whose environment raised are gone (``rollout.metrics["episodes/env_errors"]``).
    """
    prompts = [p.prompt for p in problems]
    if not is_episode_task(task):
        rollout = sampler.generate(prompts, params)
        return rollout, score_rollout(task, problems, rollout)
    limits = limits or RolloutConfig()
    rollout = sampler.run_episodes(
        prompts,
        lambda i: task.make_env(problems[i]),
        params,
        max_turns=limits.max_turns,
        max_tokens=limits.max_episode_tokens,
        skip_env_errors=limits.skip_env_errors,
    )
    return rollout, rollout.rewards


def score_rollout(task: Task, problems: Sequence[Problem], rollout: Rollout) -> torch.Tensor:
    """Each row's reward ``[B]`` float32: the task's score of its text against the problem it
    answers (row ``i`` answers ``problems[rollout.group_ids[i]]``), or, for episodes, the
    environments' summed rewards the rollout carries."""
    if rollout.rewards is not None:
        return rollout.rewards
    answered = [problems[i] for i in rollout.group_ids.tolist()]
    return torch.tensor(task.score(rollout.texts, answered), dtype=torch.float32)


def whole_groups(
    rollout: Rollout, scores: torch.Tensor, problems: Sequence[Problem], group_size: int
) -> tuple[Rollout, torch.Tensor, list[Problem]]:
    """The groups of ``rollout`` that still have all ``group_size`` rows, their scores and
    problems; as given when none is missing.

    Rows go missing only when ``rollout.skip_env_errors`` dropped episodes whose environment
    raised: a group's advantages need all of its rows. ``ValueError`` when no group is whole.
    """
    counts = torch.bincount(rollout.group_ids, minlength=len(problems))
    whole = (counts == group_size).nonzero().squeeze(1)
    if len(whole) == len(problems):
        return rollout, scores, list(problems)
    if len(whole) == 0:
        raise ValueError(
            "every group lost a row to an environment error (rollout.skip_env_errors): "
            "nothing is left to train on this step"
        )
    rows = torch.isin(rollout.group_ids, whole)
    return select_groups(rollout, whole), scores[rows], [problems[g] for g in whole.tolist()]


def episode_metrics(rollout: Rollout, dist_info: Dist) -> dict[str, float]:
    """``episodes/*`` of a multi-turn rollout over every rank: turns per episode, the fraction
    cut (``truncated``), seconds in the environments (summed over ranks) and rows dropped."""
    turns, rows, cut = dist_info.sum(
        [
            float(rollout.num_turns.sum()),
            float(len(rollout.num_turns)),
            float(rollout.batch["truncated"].sum()),
        ]
    )
    env_time, errors = dist_info.sum(
        [rollout.metrics.get(k, 0.0) for k in ("episodes/env_time_s", "episodes/env_errors")]
    )
    return {
        "episodes/turns_mean": turns / rows,
        "episodes/truncated_frac": cut / rows,
        "episodes/env_time_s": env_time,
        "episodes/env_errors": errors,
    }


def reward_metrics(task: Task, dist_info: Dist) -> dict[str, float]:
    """The model-based reward terms' counters since the last call, summed over every rank:
    ``judge/requests``, ``judge/retries``, ``judge/cache_hits``, ``judge/failures`` and
    ``reward_model/score_mean`` (the raw score's mean over the rows scored, when some were); {} for a task
    without such terms (docs/tasks.md#reward-models). Counted when scored: with
    ``rollout.max_staleness > 0`` a step may count rows scored ahead for a later step."""
    reward = getattr(task, "reward", None)
    drain = getattr(reward, "drain_metrics", None)
    local = drain() if drain is not None else {}
    if not local:
        return {}
    names = sorted(local)
    totals = dict(zip(names, dist_info.sum([local[n] for n in names]), strict=True))
    rows = totals.pop("reward_model/rows", None)
    score_sum = totals.pop("reward_model/score_sum", None)
    if rows:  # (none scored since the last step: no mean)
        totals["reward_model/score_mean"] = score_sum / rows
    return totals
