"""What an RL recipe needs from a task: prompts to train on, held-out prompts, and a reward."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Problem", "Task", "answers_for"]


@dataclass(frozen=True)
class Problem:
    """One prompt and the reference answer its reward compares against; a dataset row's other
    columns (``columns``: name -> value) go to the reward functions too, by name. ``images``: the
    PIL images of a vision-language prompt, one per image placeholder in ``prompt``, in order
    (:mod:`microrl.rollout.images`)."""

    prompt: str  # the text the policy continues, e.g. "12+7="
    answer: str  # the reference answer, e.g. "19"
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    images: tuple[Any, ...] = field(default=(), compare=False, repr=False)


@runtime_checkable
class Task(Protocol):
    """Training prompts, held-out prompts and their reward.

    ``score(responses, problems)`` gets the decoded response texts (special tokens removed) and
    the problems they answer, row by row, and returns one float per row. A held-out response
    counts as solved when its score is at least ``solved_threshold`` (the recipes' accuracy).
    """

    solved_threshold: float

    def sample(self, rng: random.Random, n: int) -> list[Problem]: ...

    def eval_problems(self) -> list[Problem]: ...

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]: ...


def answers_for(responses: Sequence[str], problems: Sequence[Problem]) -> list[str]:
    """The reference answers of ``problems``, one per response: what a ``score`` compares the
    responses against; a ValueError when the counts differ (``zip`` would drop rows silently)."""
    if len(responses) != len(problems):
        raise ValueError(f"got {len(responses)} responses for {len(problems)} problems")
    return [p.answer for p in problems]
