"""DAPO's dynamic sampling: sample fresh prompts until a step has enough groups whose rewards
differ (Yu et al. 2025, arXiv 2503.14476, section 3.2; docs/recipes.md#dapos-knobs).
An equal-reward group has advantage 0: no gradient, only tokens in the token-mean denominator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from microrl.losses import group_stats
from microrl.rollout import Rollout, merge_rollouts, select_groups
from microrl.run.dist import Dist
from microrl.tasks import Problem

__all__ = ["GroupFilter"]


class GroupFilter:
    """The groups of one step, kept round by round: the first ``n_prompts`` groups whose rewards
    (task score plus ``shaping(rollout)``) are not all equal, in sampling order; "equal" is
    :func:`microrl.losses.group_stats`' float64 spread, as the advantages decide.

    Every rank runs the same number of rounds (``hf`` generates collectively); a rank short
    after ``max_rounds`` tops up with its last round's first equal-reward groups.
    """

    def __init__(
        self,
        n_prompts: int,
        dist_info: Dist,
        *,
        max_rounds: int,
        shaping: Callable[[Rollout], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"rollout.max_sampling_rounds must be >= 1, got {max_rounds!r}")
        if n_prompts < 1:
            raise ValueError(f"n_prompts must be >= 1, got {n_prompts}")
        self.n_prompts, self.dist_info = n_prompts, dist_info
        self.max_rounds, self.shaping = max_rounds, shaping
        self._rounds: list[tuple[list[Problem], Rollout, torch.Tensor, list[int]]] = []
        self._kept = self._dropped = self._surplus = 0
        self._equal: list[int] = []  # the last round's equal-reward groups

    def add(self, problems: list[Problem], rollout: Rollout, scores: torch.Tensor) -> bool:
        """Take a round (``scores`` ``[B]``, the task's); True while the step needs another
        (on some rank, below ``max_rounds``). Collective while it can return True."""
        rewards = scores if self.shaping is None else scores + self.shaping(rollout)
        spread = torch.zeros(len(problems), dtype=torch.bool)
        spread[rollout.group_ids[~group_stats(rewards, rollout.group_ids).zero_spread]] = True
        groups = spread.nonzero().squeeze(1).tolist()
        self._equal = (~spread).nonzero().squeeze(1).tolist()
        take = groups[: self.n_prompts - self._kept]  # a rank with enough keeps none of these
        self._kept += len(take)
        self._surplus += len(groups) - len(take)
        self._dropped += len(self._equal)
        self._rounds.append((problems, rollout, scores, take))
        # The first test is the same on every rank, so every rank joins the all-reduce or none.
        return len(self._rounds) < self.max_rounds and self.dist_info.any(
            self._kept < self.n_prompts
        )

    def result(
        self, *, pad_token_id: int
    ) -> tuple[list[Problem], Rollout, torch.Tensor, dict[str, float]]:
        """``(problems, rollout, scores, metrics)`` of the kept groups in sampling order, merged
        into one batch (:func:`microrl.rollout.merge_rollouts`); ``scores`` ``[B]`` without
        ``shaping``. Metrics: ``dynamic_sampling/rounds`` and, summed over ranks,
        ``dynamic_sampling/groups_dropped``, ``groups_filled`` (the top-up) and
        ``groups_surplus``. Collective under ``torchrun``."""
        if not self._rounds:
            raise RuntimeError("GroupFilter.result needs at least one round (add)")
        rounds, dropped = list(self._rounds), self._dropped
        filled = self.n_prompts - self._kept
        if filled:  # the cap: the last round's first equal-reward groups (advantage 0)
            problems, rollout, scores, take = rounds[-1]
            rounds[-1] = (problems, rollout, scores, sorted(take + self._equal[:filled]))
            dropped -= filled
        parts, kept_problems, kept_scores = [], [], []
        for problems, rollout, scores, take in rounds:
            if not take:
                continue
            parts.append(select_groups(rollout, take))
            kept_problems += [problems[g] for g in sorted(take)]
            kept_scores.append(scores[torch.isin(rollout.group_ids, torch.tensor(take))])
        merged = merge_rollouts(parts, pad_token_id=pad_token_id)
        dropped, filled, surplus = self.dist_info.sum([dropped, filled, self._surplus])
        metrics = {
            "dynamic_sampling/rounds": float(len(rounds)),
            "dynamic_sampling/groups_dropped": dropped,
            "dynamic_sampling/groups_filled": filled,
            "dynamic_sampling/groups_surplus": surplus,
        }
        return kept_problems, merged, torch.cat(kept_scores), metrics
