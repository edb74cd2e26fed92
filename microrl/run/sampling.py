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
from microrl.engine.rollout import Rollout, RolloutBackend, SamplingParams
from microrl.tasks import Problem, Task, is_episode_task

__all__ = ["sample_and_score"]


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
        answered = [problems[i] for i in rollout.group_ids.tolist()]
        return rollout, torch.tensor(task.score(rollout.texts, answered), dtype=torch.float32)
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
