"""The toy vision task: read the number drawn in a tiny image, answer it as text.

A prompt is one image placeholder then a short question, ``"<|vision_start|><|image_pad|>
<|vision_end|>number?"``, with its image: a number in ``[0, max_operand]`` (at most two digits)
drawn black on white in a 3x5-pixel font at twice that scale, its corner on the 4-pixel patch
grid of a 24x24-pixel canvas, with a few grey specks of noise. The answer is the number
(``"42"``); the reward is exact match, as for addition
(:func:`~microrl.tasks.addition.exact_match_reward`).

Every image is one *variant*: (number, position, noise). The held-out variants are drawn first
from the seed and never trained on, so the held-out accuracy measures reading unseen images, not
recall. What the toy model learns on a CPU was measured: one digit (``task.max_operand=9``)
on the patch grid is learnt (0.40 greedy held-out accuracy after 80 supervised steps of 64 rows,
docs/tasks.md#the-toy-vision-task); free positions or varied colours were not learnt in 600.
Images are drawn with PIL rectangles only (no font file), so a seed gives the same pixels
on every machine. The toy vision-language model (:mod:`microrl.run.toy_vision`) is built and
warm-started for it (``model.path=outputs/base/tiny-digits``; docs/tasks.md#the-toy-vision-task).
"""

from __future__ import annotations

import random

from PIL import Image, ImageDraw

from microrl.tasks.addition import exact_match_reward
from microrl.tasks.base import Problem, answers_for
from microrl.tasks.images import IMAGE_PLACEHOLDER

__all__ = ["IMAGE_PLACEHOLDER", "DigitsTask", "draw_number"]

QUESTION = "number?"
IMAGE_SIZE = 24  # pixels, square
SCALE = 2  # each font pixel is a SCALE x SCALE square
MAX_NUMBER = 99  # two digits at most: two glyphs fit the canvas at any of many positions

# 3x5 glyphs, rows top to bottom.
_FONT = {
    "0": ("111", "101", "101", "101", "111"),
    "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"),
    "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"),
    "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"),
    "7": ("111", "001", "010", "010", "010"),
    "8": ("111", "101", "111", "101", "111"),
    "9": ("111", "101", "111", "001", "111"),
}
INK, PAPER, SPECK = (0, 0, 0), (255, 255, 255), (128, 128, 128)
GRID = 4  # glyphs start on the image processor's 4-pixel patch grid
NOISE_SEEDS = 16  # noise patterns per (number, position)
SPECKS = 3  # grey pixels of noise per image


def _width(text: str) -> int:
    return (4 * len(text) - 1) * SCALE  # 3 pixels a glyph, 1 between glyphs


def draw_number(number: int, x: int, y: int, noise: int) -> Image.Image:
    """The RGB image of ``number`` with its top-left corner at ``(x, y)`` and noise pattern
    ``noise`` (:data:`SPECKS` grey pixels placed by ``random.Random(noise)``)."""
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), PAPER)
    draw = ImageDraw.Draw(image)
    specks = random.Random(noise)
    for _ in range(SPECKS):
        draw.point((specks.randrange(IMAGE_SIZE), specks.randrange(IMAGE_SIZE)), fill=SPECK)
    for k, digit in enumerate(str(number)):
        left = x + 4 * k * SCALE
        for row, bits in enumerate(_FONT[digit]):
            for col, bit in enumerate(bits):
                if bit == "1":
                    x0, y0 = left + col * SCALE, y + row * SCALE
                    draw.rectangle((x0, y0, x0 + SCALE - 1, y0 + SCALE - 1), fill=INK)
    return image


class DigitsTask:
    """Images of numbers in ``[0, max_operand]`` to read; a held-out set of image variants is
    never trained on.

    Constructed as the built-in tasks are, ``DigitsTask(max_operand, eval_size, seed)``
    (``task.max_operand``, ``task.eval_size``, ``task.seed``); ``max_operand <= 99``.
    """

    solved_threshold = 1.0  # exact match
    # The characters of its prompts and answers, and the vision-language toy model's image size
    # and tokens: the toy model can be built and warm-started for it (microrl.run.base_model).
    toy_alphabet = "0123456789" + QUESTION
    image_size = IMAGE_SIZE

    def __init__(self, max_operand: int = MAX_NUMBER, eval_size: int = 200, seed: int = 0) -> None:
        if not 0 < max_operand <= MAX_NUMBER:
            raise ValueError(
                f"task.max_operand must be in [1, {MAX_NUMBER}] for task.name=digits (numbers "
                f"of at most two digits), got {max_operand}"
            )
        self.max_operand = max_operand
        # A variant is (number, x, y, noise); its index enumerates them all.
        self._variants = [
            (n, x, y, k)
            for n in range(max_operand + 1)
            for x in range(0, IMAGE_SIZE - _width(str(n)) + 1, GRID)
            for y in range(0, IMAGE_SIZE - 5 * SCALE + 1, GRID)
            for k in range(NOISE_SEEDS)
        ]
        if not 0 < eval_size < len(self._variants) // 2:
            raise ValueError(
                f"task.eval_size must be in [1, {len(self._variants) // 2 - 1}] for "
                f"task.name=digits with task.max_operand={max_operand}, got {eval_size}"
            )
        order = list(range(len(self._variants)))
        random.Random(seed).shuffle(order)
        self._eval = order[:eval_size]
        self._held_out = set(self._eval)

    def make(self, index: int) -> Problem:
        number, x, y, noise = self._variants[index]
        return Problem(
            prompt=IMAGE_PLACEHOLDER + QUESTION,
            answer=str(number),
            images=(draw_number(number, x, y, noise),),
        )

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training problems: variants drawn with replacement, never a held-out one."""
        out = []
        while len(out) < n:
            index = rng.randrange(len(self._variants))
            if index not in self._held_out:  # held out: at most half the variants, so this ends
                out.append(self.make(index))
        return out

    def eval_problems(self) -> list[Problem]:
        return [self.make(i) for i in self._eval]

    def score(self, responses: list[str], problems: list[Problem]) -> list[float]:
        answers = answers_for(responses, problems)
        return [exact_match_reward(r, a) for r, a in zip(responses, answers, strict=True)]

    @property
    def max_answer_chars(self) -> int:
        return len(str(self.max_operand))
