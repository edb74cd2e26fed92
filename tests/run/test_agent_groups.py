"""GRPO over agent rollouts (microrl/run/sampling.py): an episode's branch rows count once in
their group, share its advantage, and whole groups are counted in episodes."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from microrl.losses import grpo_advantages
from microrl.rollout import Rollout
from microrl.run import group_advantages, whole_groups
from microrl.tasks import Problem


def _rollout(episodes: list[int], groups: list[int]) -> Rollout:
    rows = len(episodes)
    batch = TensorDict(
        {"input_ids": torch.zeros(rows, 2, dtype=torch.long), "episode_id": torch.tensor(episodes)},
        batch_size=[rows],
    )
    return Rollout(batch=batch, texts=[""] * rows, group_ids=torch.tensor(groups))


def test_branch_rows_share_their_episodes_advantage():
    # episodes 7 (two rows: a branch), 9 | 4, 5: each group has 2 episodes
    rollout = _rollout([7, 9, 7, 4, 5], [0, 0, 0, 1, 1])
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 2.0])
    advantages = group_advantages(rollout, scores, group_size=2)
    expected = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.tensor([0, 0, 1, 1]))[0]
    assert advantages.tolist() == pytest.approx(expected[[0, 1, 0, 2, 3]].tolist())
    with pytest.raises(ValueError):  # 3 episodes counted as rows would not be a group of 2
        group_advantages(_rollout([1, 2, 3, 4], [0, 0, 0, 1]), scores[:4], group_size=2)


def test_whole_groups_count_episodes_not_rows():
    rollout = _rollout([7, 7, 8, 4], [0, 0, 0, 1])  # group 1 lost an episode
    problems = [Problem("a", "1"), Problem("b", "2")]
    kept, scores, left = whole_groups(rollout, torch.arange(4.0), problems, group_size=2)
    assert kept.group_ids.tolist() == [0, 0, 0] and scores.tolist() == [0.0, 1.0, 2.0]
    assert left == problems[:1]
