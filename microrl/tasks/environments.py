"""Multi-turn tasks: prompts whose episodes are played against an environment (docs/tasks.md).

A task with a ``make_env(problem)`` method is played with
:meth:`~microrl.rollout.RolloutBackend.run_episodes` instead of sampled once: the recipe
makes one environment per row, the episode's reward is the sum of the environment's per-turn
rewards, and a held-out episode is solved when that sum is at least ``solved_threshold``.

- :class:`HintedAdditionTask` (``task.name=hinted_addition``): the addition task as a guessing
  game. A wrong answer gets a hint, ``+`` (the sum is larger) or ``-`` (smaller), and another
  guess, up to :attr:`HintedAdditionTask.max_guesses`. The toy model learns it on a CPU.
- :class:`EnvTask` (``task.name=env``): the prompts of ``task.dataset.train_file`` played against the
  environments ``task.env`` (``module:factory``) builds, e.g. skyrl-gym's.

Environments follow skyrl-gym's text-environment API (``init``/``step``, see
:class:`~microrl.rollout.episodes.TextEnv`); skyrl-gym's own ``BaseTextEnv`` subclasses
run unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from microrl.tasks.addition import AdditionTask, parse_answer
from microrl.tasks.base import Problem, Task

__all__ = ["EnvTask", "HintEnv", "HintedAdditionTask", "is_episode_task"]


def is_episode_task(task: Any) -> bool:
    """Whether ``task`` is played as multi-turn episodes (it has ``make_env(problem)``)."""
    return callable(getattr(task, "make_env", None))


class HintEnv:
    """Guess the sum: ``+``/``-`` hints after a wrong guess, reward 1.0 for the right one.

    The game ends (``done``) at the right guess or after ``max_guesses`` wrong ones; a guess that
    is not a plain number gets the hint ``*`` (no direction). The hint is the whole observation,
    a user message, so under the toy model's plain template a trajectory reads
    ``12+7=18<eos>+19<eos>``.
    """

    def __init__(self, answer: int, max_guesses: int) -> None:
        self.answer = answer
        self.max_guesses = max_guesses
        self.guesses = 0

    def init(self, prompt: Any) -> tuple[Any, dict]:
        return prompt, {}

    def step(self, action: str) -> dict[str, Any]:
        self.guesses += 1
        guess = parse_answer(action)
        if guess == str(self.answer):  # exact: no leading zeros, as AdditionTask scores
            return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}
        done = self.guesses >= self.max_guesses
        observations = [] if done else [{"role": "user", "content": self.hint(guess)}]
        return {"observations": observations, "reward": 0.0, "done": done, "metadata": {}}

    def hint(self, guess: str | None) -> str:
        if guess is None or int(guess) == self.answer:  # malformed, or right with leading zeros
            return "*"
        return "+" if int(guess) < self.answer else "-"


class HintedAdditionTask(AdditionTask):
    """The addition task played over up to :attr:`max_guesses` turns with ``+``/``-`` hints.

    Same prompts and held-out split as :class:`AdditionTask`; solved when some guess is right.
    Three guesses of at most 4 tokens and two 1-token hints take 14 tokens after the prompt.
    """

    max_guesses = 3

    def make_env(self, problem: Problem) -> HintEnv:
        return HintEnv(int(problem.answer), self.max_guesses)


class EnvTask:
    """A prompt file's rows played against the environments a factory builds.

    ``prompts`` (a :class:`~microrl.tasks.Task` over the file: its ``sample`` and
    ``eval_problems``) gives the problems; ``factory(problem)`` returns a fresh environment for
    one row (a skyrl-gym ``BaseTextEnv`` or anything with ``init``/``step``), e.g.
    ``lambda p: GSM8kMultiTurnEnv(extras={"reward_spec": {"ground_truth": p.answer}})``.
    """

    def __init__(
        self, prompts: Task, factory: Callable[[Problem], Any], solved_threshold: float
    ) -> None:
        self.prompts = prompts
        self.factory = factory
        self.solved_threshold = solved_threshold

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return self.prompts.sample(rng, n)

    def eval_problems(self) -> list[Problem]:
        return self.prompts.eval_problems()

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        raise TypeError(
            "task.name=env is scored by its environments' rewards: play it with "
            "RolloutBackend.run_episodes, not generate + score"
        )

    def make_env(self, problem: Problem) -> Any:
        return self.factory(problem)
