"""A second built-in task: small arithmetic word problems with a numeric answer.

``"Tom has 3 apples and gets 4 more. How many apples now?"`` -> ``"7"``. The set is generated,
deterministic by its seed, and small enough to enumerate: every (operation, a, b) of three
templates (add, take away, equal bags) with quantities up to ``max_number``; a name and an item
are drawn once per triple. A held-out set of triples is never trained on. The reward reads the
*last number* the response writes (:func:`microrl.tasks.rewards.numeric_match`), so
``"7"``, ``"7 apples"`` and ``"so 3+4=7"`` all score 1.0: a different reward than addition's
exact match, going through the same task protocol.

Every prompt uses only :data:`WORD_ALPHABET` (letters, digits, space, ``.`` and ``?``): the toy
character tokenizer of the examples is built over it when this task needs a fresh base model
(``task.name=word_problems`` with an empty ``model.path``).
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence

from microrl.tasks.base import Problem, answers_for
from microrl.tasks.rewards import numeric_match

__all__ = ["WORD_ALPHABET", "WordProblemTask"]

# What the prompts and answers are written with (the toy tokenizer appends what it lacks).
WORD_ALPHABET = "0123456789 " + string.ascii_letters + ".?"

NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Eva", "Joe", "Liz")
ITEMS = ("apples", "pens", "books", "coins", "cards", "eggs", "shells", "stamps")
# (operation, template, answer); each template names the same item twice.
TEMPLATES = {
    "add": "{name} has {a} {item} and gets {b} more. How many {item} now?",
    "sub": "{name} has {a} {item} and gives away {b}. How many {item} are left?",
    "mul": "{name} buys {a} bags of {b} {item}. How many {item} in all?",
}
MAX_BAGS = 9  # "mul" takes 2..9 bags: answers stay within 3 digits for numbers up to 99


def _answer(op: str, a: int, b: int) -> int:
    return a + b if op == "add" else a - b if op == "sub" else a * b


class WordProblemTask:
    """Arithmetic word problems with quantities in ``[0, max_number]``; ``eval_size`` held out.

    ``sample(rng, n)`` draws training problems with replacement; ``eval_problems()`` is the fixed
    held-out set; ``score`` is 1.0 when the last number in a response equals the answer.
    """

    solved_threshold = 1.0
    toy_alphabet = WORD_ALPHABET

    def __init__(self, max_number: int = 99, eval_size: int = 200, seed: int = 0) -> None:
        if max_number < 2:
            raise ValueError(f"task.max_operand must be >= 2 for word problems, got {max_number}")
        triples = [("add", a, b) for a in range(max_number + 1) for b in range(max_number + 1)]
        triples += [("sub", a, b) for a in range(max_number + 1) for b in range(a + 1)]
        triples += [("mul", a, b) for a in range(2, MAX_BAGS + 1) for b in range(max_number + 1)]
        if not 0 < eval_size < len(triples):
            raise ValueError(
                f"task.eval_size must be in [1, {len(triples) - 1}] for word problems with "
                f"task.max_operand={max_number}, got {eval_size}"
            )
        rng = random.Random(seed)
        problems = [
            Problem(
                prompt=TEMPLATES[op].format(
                    name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b
                ),
                answer=str(_answer(op, a, b)),
            )
            for op, a, b in triples
        ]
        rng.shuffle(problems)
        self.max_number = max_number
        self._eval = problems[:eval_size]
        self._train = problems[eval_size:]

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training problems drawn with replacement (never a held-out one)."""
        return [rng.choice(self._train) for _ in range(n)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        return numeric_match(responses, answers_for(responses, problems))
