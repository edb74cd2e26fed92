"""The verifiable task: add two numbers, answer with the exact sum.

A prompt is ``"12+7="`` and the right answer is ``"19"``. The reward reads only the text the model
wrote after the prompt (up to its end-of-sequence token): 1.0 when it is exactly the sum, else 0.0.
Nothing about the prompt or the model's internals leaks into the score, so the reward cannot be
gamed by anything but answering correctly.

Why addition: a ~100k-parameter model learns it on a CPU in minutes, carries make it hard enough that
a short supervised warm start only gets part of the way, and exact match is unambiguous.
"""

from __future__ import annotations

import random

from microrl.tasks.base import Problem, answers_for

__all__ = ["AdditionTask", "exact_match_reward", "parse_answer"]


def parse_answer(response: str) -> str | None:
    """The model's answer from its response text, or None when it is not a plain number.

    ``response`` is the decoded text after the prompt, special tokens removed. Surrounding
    whitespace is ignored; anything else (a sign, a second ``=``, digits after a space) makes the
    answer malformed, so it scores 0.
    """
    text = response.strip()
    return text if text.isdigit() and text.isascii() else None


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the response parses to exactly ``answer`` (no leading zeros allowed), else 0.0."""
    parsed = parse_answer(response)
    return 1.0 if parsed is not None and parsed == answer else 0.0


class AdditionTask:
    """Prompts ``"a+b="`` with ``0 <= a, b <= max_operand``; a held-out set is never trained on.

    The held-out evaluation prompts are drawn first from their own seed and removed from the
    training distribution, so the accuracy reported on them measures generalisation, not recall.
    """

    solved_threshold = 1.0  # exact match: a response is right (1.0) or wrong (0.0)
    # The characters of its prompts and answers: the toy model can be built and warm-started for
    # it (microrl.run.base_model; the toy tokenizer already has them all).
    toy_alphabet = "0123456789+="

    def __init__(self, max_operand: int = 99, eval_size: int = 200, seed: int = 0) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        n_pairs = (max_operand + 1) ** 2
        if not 0 < eval_size < n_pairs:
            raise ValueError(f"eval_size must be in [1, {n_pairs - 1}], got {eval_size}")
        self.max_operand = max_operand
        pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
        random.Random(seed).shuffle(pairs)
        self._eval_pairs = pairs[:eval_size]
        self._train_pairs = pairs[eval_size:]

    @staticmethod
    def make(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training problems drawn with replacement from the training pairs."""
        return [self.make(*rng.choice(self._train_pairs)) for _ in range(n)]

    def eval_problems(self) -> list[Problem]:
        return [self.make(a, b) for a, b in self._eval_pairs]

    def score(self, responses: list[str], problems: list[Problem]) -> list[float]:
        answers = answers_for(responses, problems)
        return [exact_match_reward(r, a) for r, a in zip(responses, answers, strict=True)]

    @property
    def max_answer_chars(self) -> int:
        return len(str(2 * self.max_operand))
