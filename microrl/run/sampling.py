"""One call for a recipe's rollout: sample (or play episodes) and score, for every kind of task,
and the step's rollout metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from microrl.agents import EPISODE_KEY, AgentLimits, run_agent_episodes
from microrl.agents.runner import AGENT_METRICS, agent_metric_means
from microrl.configs.run import RolloutConfig
from microrl.losses import check_whole_groups, grpo_advantages
from microrl.rollout import Rollout, RolloutBackend, SamplingParams, select_groups
from microrl.rollout.images import problem_images
from microrl.run.dist import Dist
from microrl.tasks import Problem, Task, is_agent_task, is_episode_task

__all__ = [
    "agent_metrics",
    "episode_metrics",
    "episode_rows",
    "group_advantages",
    "reward_metrics",
    "rollout_metrics",
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
    """The rollout of ``params.num_samples`` rows per problem and each row's reward ``[B]``;
    row ``i`` answers ``problems[rollout.group_ids[i]]``. ``limits``: a multi-turn task's."""
    prompts = [p.prompt for p in problems]
    limits = limits or RolloutConfig()
    if is_agent_task(task):  # the user's agent, through the endpoint (docs/rollouts.md#agents)
        rollout = run_agent_episodes(
            sampler,
            problems,
            task.agent,
            params,
            agent_limits(task, limits),
            reward=task.reward,
            tool_parser=task.tool_parser,
        )
        return rollout, rollout.rewards
    if not is_episode_task(task):  # a problem's images go with it (docs/rollouts.md#images)
        rollout = sampler.generate(prompts, params, images=problem_images(problems))
        return rollout, score_rollout(task, problems, rollout)
    make_env = lambda i: task.make_env(problems[i])  # noqa: E731 - one per row
    rollout = sampler.run_episodes(
        prompts, make_env, params, images=problem_images(problems), **episode_limits(limits)
    )
    return rollout, rollout.rewards


def episode_limits(limits: RolloutConfig) -> dict[str, Any]:
    """A multi-turn rollout's bounds, as ``run_episodes`` and ``submit_episodes`` take them."""
    return {
        "max_turns": limits.max_turns,
        "max_tokens": limits.max_episode_tokens,
        "skip_env_errors": limits.skip_env_errors,
    }


def agent_limits(task: Any, limits: RolloutConfig) -> AgentLimits:
    """An agent task's episode bounds: its ``task.agent.*`` and the rollout's limits."""
    return AgentLimits(
        timeout_s=task.timeout_s,
        max_tokens=limits.max_episode_tokens,
        max_concurrency=task.max_concurrency,
        skip_errors=limits.skip_env_errors,
        host=task.host,
    )


def episode_rows(rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An agent rollout's row episodes ``[B]`` and their first rows ``[E]``; None: a row each."""
    if EPISODE_KEY not in rollout.batch.keys():  # noqa: SIM118 - a TensorDict
        return None
    _, episode = torch.unique(rollout.batch[EPISODE_KEY], return_inverse=True)
    rows = torch.arange(len(episode), device=episode.device)
    first = torch.full((int(episode.max()) + 1,), len(episode), device=episode.device)
    return episode, first.scatter_reduce_(0, episode, rows, "amin")


def group_advantages(rollout: Rollout, scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO advantages ``[B]``; an agent episode's branches count once and share its advantage."""
    episodes = episode_rows(rollout)
    if episodes is None:
        check_whole_groups(rollout.group_ids, group_size)
        return grpo_advantages(scores, rollout.group_ids)[0]
    episode, first = episodes
    check_whole_groups(rollout.group_ids[first], group_size)
    return grpo_advantages(scores[first], rollout.group_ids[first])[0][episode]


def score_rollout(task: Task, problems: Sequence[Problem], rollout: Rollout) -> torch.Tensor:
    """Each row's reward ``[B]`` float32: the task's score, or the episodes' summed rewards."""
    if rollout.rewards is not None:
        return rollout.rewards
    answered = [problems[i] for i in rollout.group_ids.tolist()]
    return torch.tensor(task.score(rollout.texts, answered), dtype=torch.float32)


def whole_groups(
    rollout: Rollout, scores: torch.Tensor, problems: Sequence[Problem], group_size: int
) -> tuple[Rollout, torch.Tensor, list[Problem]]:
    """The groups of ``rollout`` that still have all ``group_size`` rows (``skip_env_errors``
    drops rows; advantages need whole groups), their scores and problems. ``ValueError``: none."""
    episodes = episode_rows(rollout)
    groups = rollout.group_ids if episodes is None else rollout.group_ids[episodes[1]]
    counts = torch.bincount(groups, minlength=len(problems))
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
    """``episodes/*`` of a multi-turn rollout over every rank."""
    turns, rows, cut, env_time, errors = dist_info.sum(
        [
            float(rollout.num_turns.sum()),
            float(len(rollout.num_turns)),
            float(rollout.batch["truncated"].sum()),
            *(rollout.metrics.get(k, 0.0) for k in ("episodes/env_time_s", "episodes/env_errors")),
        ]
    )
    return {
        "episodes/turns_mean": turns / rows,
        "episodes/truncated_frac": cut / rows,
        "episodes/env_time_s": env_time,
        "episodes/env_errors": errors,
    }


def agent_metrics(rollout: Rollout, dist_info: Dist) -> dict[str, float]:
    """``agent/*`` of an agent rollout over every rank (docs/rollouts.md#agents)."""
    sums = dist_info.sum([rollout.metrics.get(k, 0.0) for k in AGENT_METRICS])
    return agent_metric_means(dict(zip(AGENT_METRICS, sums, strict=True)))


def reward_metrics(task: Task, dist_info: Dist) -> dict[str, float]:
    """The model-based reward terms' counters since the last call, summed over every rank
    (``judge/*``, ``reward_model/score_mean``; docs/tasks.md#reward-models); {} without any."""
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


def rollout_metrics(task: Task, rollout: Rollout, dist_info: Dist) -> dict[str, float]:
    """The step's task metrics over every rank: ``episodes/*``, ``agent/*``, ``judge/*``, ..."""
    metrics = reward_metrics(task, dist_info)
    if is_episode_task(task):
        metrics.update(episode_metrics(rollout, dist_info))
    if is_agent_task(task):  # docs/rollouts.md#agents
        metrics.update(agent_metrics(rollout, dist_info))
    return metrics
