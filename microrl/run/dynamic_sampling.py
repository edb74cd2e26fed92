"""DAPO's dynamic sampling: sample fresh prompts until a step has enough groups whose rewards
differ (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv
2503.14476, section 3.2; docs/recipes.md#dapos-knobs).

A GRPO group whose rewards are all equal (every response right, or every one wrong) has advantage
exactly 0 (:func:`microrl.losses.grpo_advantages`): it adds no gradient, only loss tokens to the
token-mean denominator, which shrinks the update of the groups that do teach something. As the
policy gets better, more groups are all right and the effective batch shrinks. Dynamic sampling
keeps only the groups with a reward spread, sampling more prompts until there are enough.

``examples/grpo_lora.py`` calls :func:`dynamic_sample` when ``rollout.dynamic_sampling`` is on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

import torch

from microrl.configs.run import RolloutConfig
from microrl.engine.rollout import (
    Rollout,
    RolloutBackend,
    SamplingParams,
    merge_rollouts,
    select_groups,
)
from microrl.losses import group_stats
from microrl.run.dist import Dist
from microrl.run.sampling import sample_and_score
from microrl.tasks import Problem, Task

__all__ = ["DynamicSample", "dynamic_sample"]


class DynamicSample(NamedTuple):
    """This rank's groups of a step: ``problems[g]`` is the prompt of the rows of group ``g`` of
    ``rollout`` (ids ``0 .. n_prompts - 1``, contiguous, rows grouped by prompt), ``scores``
    ``[B]`` the task's score of each row (without the ``shaping`` term), ``metrics`` the
    ``dynamic_sampling/*`` counts of all ranks."""

    problems: list[Problem]
    rollout: Rollout
    scores: torch.Tensor
    metrics: dict[str, float]


def dynamic_sample(
    task: Task,
    sampler: RolloutBackend,
    params: SamplingParams,
    rng: random.Random,
    n_prompts: int,
    dist_info: Dist,
    *,
    max_rounds: int,
    shaping: Callable[[Rollout], torch.Tensor] | None = None,
    sample: Callable[[list[Problem]], tuple[Rollout, torch.Tensor]] | None = None,
    limits: RolloutConfig | None = None,
) -> DynamicSample:
    """Sample rounds of ``n_prompts`` fresh prompts (``params.num_samples`` responses each) until
    this rank holds ``n_prompts`` groups whose rewards are not all equal, on every rank, or
    ``max_rounds`` rounds ran.

    A round is ``sample(problems) -> (rollout, scores [B])``; by default
    :func:`~microrl.run.sampling.sample_and_score` (``generate`` and the task's reward, or a
    multi-turn task's episodes under ``limits``), as ``examples/grpo_lora.py`` samples without
    dynamic sampling. Row ``i`` of a round's rollout answers ``problems[rollout.group_ids[i]]``.

    The reward of a row is its task score plus ``shaping(rollout)`` (e.g. the overlong penalty,
    a per-row ``[B]`` term), so a group is kept exactly when the advantages computed from that
    reward are not all zero (the float64 spread of :func:`microrl.losses.group_stats`, as
    :func:`~microrl.losses.grpo_advantages` decides). The returned scores are the task's
    scores; the caller adds the shaping term again, on the merged rollout.

    **Rounds.** Every rank runs the same number of rounds: after each, a rank that still lacks
    groups makes all of them continue (one all-reduce, ``dist_info``), since the ``hf`` sampler
    generates collectively under data parallelism (``synced_gpus`` over FSDP2-sharded
    weights). A rank that already has enough samples in those rounds too and keeps its first
    ``n_prompts`` spread groups in sampling order; the spread groups after them are surplus.

    **Top-up.** When ``max_rounds`` rounds leave a rank short, it tops its groups up with the
    first equal-reward groups of its last round (there are always enough: that round's spread
    groups are all kept). Their advantage is 0: like the groups of a step without dynamic
    sampling, they add only to the loss's token-mean denominator. So the step always has
    ``n_prompts`` groups per rank, and the batch size (and the mini-batch divisibility) never
    changes; ``dynamic_sampling/groups_filled`` counts them.

    **Result.** The kept groups in sampling order (earlier rounds first), merged into one batch
    of the rollout layout (:func:`microrl.engine.rollout.merge_rollouts`). Metrics:
    ``dynamic_sampling/rounds`` (the same on every rank), and summed over ranks
    ``dynamic_sampling/groups_dropped`` (equal-reward groups left out),
    ``dynamic_sampling/groups_filled`` (equal-reward groups kept as the top-up) and
    ``dynamic_sampling/groups_surplus`` (spread groups beyond ``n_prompts`` left out).
    """
    if not isinstance(max_rounds, int) or max_rounds < 1:
        raise ValueError(f"rollout.max_sampling_rounds must be >= 1, got {max_rounds!r}")
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
    rounds: list[tuple[list[Problem], Rollout, torch.Tensor, list[int]]] = []
    kept = dropped = surplus = 0
    equal: list[int] = []
    for round_number in range(1, max_rounds + 1):
        problems = task.sample(rng, n_prompts)
        if sample is None:
            rollout, scores = sample_and_score(sampler, task, problems, params, limits)
        else:
            rollout, scores = sample(problems)
        rewards = scores if shaping is None else scores + shaping(rollout)
        spread = torch.zeros(len(problems), dtype=torch.bool)
        spread[rollout.group_ids[~group_stats(rewards, rollout.group_ids).zero_spread]] = True
        groups = spread.nonzero().squeeze(1).tolist()
        equal = (~spread).nonzero().squeeze(1).tolist()
        take = groups[: n_prompts - kept]  # a rank with enough keeps none of this round's
        kept += len(take)
        surplus += len(groups) - len(take)
        dropped += len(equal)
        rounds.append((problems, rollout, scores, take))
        # The first test is the same on every rank, so every rank joins the all-reduce or none.
        if round_number == max_rounds or not dist_info.any(kept < n_prompts):
            break
    filled = n_prompts - kept
    if filled:  # the cap: the last round's first equal-reward groups (advantage 0)
        problems, rollout, scores, take = rounds[-1]
        rounds[-1] = (problems, rollout, scores, sorted(take + equal[:filled]))
        dropped -= filled
    parts, kept_problems, kept_scores = [], [], []
    for problems, rollout, scores, take in rounds:
        if not take:
            continue
        rows = torch.isin(rollout.group_ids, torch.tensor(take)).nonzero().squeeze(1)
        parts.append(select_groups(rollout, take))
        kept_problems += [problems[g] for g in sorted(take)]
        kept_scores.append(scores[rows])
    merged = merge_rollouts(parts, pad_token_id=sampler.tokenizer.pad_token_id)
    dropped, filled, surplus = dist_info.sum([dropped, filled, surplus])
    metrics = {
        "dynamic_sampling/rounds": float(len(rounds)),
        "dynamic_sampling/groups_dropped": dropped,
        "dynamic_sampling/groups_filled": filled,
        "dynamic_sampling/groups_surplus": surplus,
    }
    return DynamicSample(kept_problems, merged, torch.cat(kept_scores), metrics)
