"""A task from the user's own prompt file: JSONL or Parquet rows with a prompt and an answer.

Each row of the file holds a prompt and its reference answer in the configured fields (other
fields are ignored)::

    {"prompt": "Tom has 3 apples and gets 4 more. How many apples now?", "answer": "7"}

The held-out prompts of the greedy accuracy are ``eval_file``'s first ``eval_size`` rows, or, with
no ``eval_file``, ``eval_size`` rows held out of ``train_file`` by a seeded shuffle (never trained
on). With ``chat_template`` the prompt (a string, taken as one user message, or a list of
``{"role", "content"}`` messages) is rendered by the tokenizer's chat template with the generation
prompt appended. Responses are scored by a :class:`~microrl.tasks.rewards.Reward` (reward
functions given by import path, weighted). Files are read with ``datasets.load_dataset``
(docs/tasks.md).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from microrl.tasks.base import Problem
from microrl.tasks.rewards import Reward, RewardFn

__all__ = ["DatasetTask", "read_rows"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_rows(path: str | Path, key: str = "task.train_file") -> Any:
    """The rows of a ``.jsonl``/``.json``/``.parquet`` file as a ``datasets.Dataset``; a missing or
    unreadable file is a ``ValueError`` naming ``key``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"{key}={str(path)!r} does not exist")
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"{key}={str(path)!r} must be a .jsonl, .json or .parquet file, got {path.suffix!r}"
        )
    import datasets  # imported on use: it is a heavy import the built-in tasks do not need

    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one file's "Generating train split" bar is noise here
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:
        raise ValueError(f"{key}={str(path)!r} could not be read as {builder}: {err}") from err
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _column(rows: Any, field: str, key: str, path: str) -> list:
    if field not in rows.column_names:
        raise ValueError(
            f"{key}={field!r} is not a field of {path} (its fields: {', '.join(rows.column_names)})"
        )
    return list(rows[field])


class DatasetTask:
    """Prompts and answers from a file, scored by ``reward(completions, answers, prompts)``.

    Args:
        train_file: ``.jsonl``, ``.json`` or ``.parquet`` file of training rows.
        reward: a :class:`~microrl.tasks.rewards.Reward` (import paths, weights), or one reward
            function ``fn(completions, answers=..., prompts=...) -> list[float]``.
        eval_file: the held-out rows; ``None`` holds ``eval_size`` rows out of ``train_file``.
        eval_size: held-out prompts (of ``eval_file``: its first ``eval_size`` rows, or all).
        seed: seed of the held-out split.
        prompt_field, answer_field: the fields of a row that hold the prompt and the answer.
        chat_template: render each prompt with ``tokenizer``'s chat template.
        tokenizer: the policy's tokenizer (needed for ``chat_template`` only).
        solved_threshold: a held-out response counts as solved at a reward >= this.
    """

    def __init__(
        self,
        train_file: str | Path,
        reward: Reward | RewardFn,
        *,
        eval_file: str | Path | None = None,
        eval_size: int = 200,
        seed: int = 0,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        chat_template: bool = False,
        tokenizer: Any = None,
        solved_threshold: float = 1.0,
    ) -> None:
        if eval_size < 1:
            raise ValueError(f"task.eval_size must be >= 1, got {eval_size}")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "task.chat_template=true needs a tokenizer with a chat template; the model's "
                "tokenizer has none (set task.chat_template=false, or use a checkpoint whose "
                "tokenizer_config.json or chat_template.jinja defines one)"
            )
        # A plain function gets the keyword handling and checks of a configured reward.
        self.reward = reward if isinstance(reward, Reward) else Reward([reward])
        self.solved_threshold = solved_threshold
        self._tokenizer = tokenizer if chat_template else None
        # A template that writes the BOS token itself, for a tokenizer that adds one too (Llama's),
        # would start every prompt with two: the rendered text drops its own.
        bos = getattr(tokenizer, "bos_token", None)
        adds_bos = (
            bool(self._tokenizer and bos) and tokenizer.bos_token_id in tokenizer("")["input_ids"]
        )
        self._strip_prefix = bos if adds_bos else None
        self._fields = (prompt_field, answer_field)
        train = self._load(train_file, "task.train_file")
        if eval_file is None:
            if not eval_size < len(train):
                raise ValueError(
                    f"task.eval_size must be below the {len(train)} rows of task.train_file="
                    f"{str(train_file)!r} (it holds the held-out rows out of them; or give "
                    f"task.eval_file), got {eval_size}"
                )
            order = list(range(len(train)))
            random.Random(seed).shuffle(order)
            self._eval = [train[i] for i in order[:eval_size]]
            self._train = [train[i] for i in order[eval_size:]]
        else:
            self._train = train
            self._eval = self._load(eval_file, "task.eval_file")[:eval_size]
        self.problem(self._train[0])  # a chat template that fails, fails now

    def _load(self, path: str | Path, key: str) -> list[tuple[Any, str]]:
        rows = read_rows(path, key)
        if len(rows) == 0:
            raise ValueError(f"{key}={str(path)!r} has no rows")
        prompt_field, answer_field = self._fields
        prompts = _column(rows, prompt_field, "task.prompt_field", str(path))
        answers = _column(rows, answer_field, "task.answer_field", str(path))
        for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            is_messages = isinstance(prompt, list) and all(
                isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt
            )
            if not (isinstance(prompt, str) or (is_messages and self._tokenizer is not None)):
                rule = "a string" + (
                    " or a list of {role, content} messages" * bool(self._tokenizer)
                )
                raise ValueError(
                    f"task.prompt_field={prompt_field!r}: row {i} of {path} holds "
                    f"{type(prompt).__name__} {prompt!r:.60}, not {rule}"
                )
            if answer is None or isinstance(answer, (list, dict)):
                raise ValueError(
                    f"task.answer_field={answer_field!r}: row {i} of {path} holds {answer!r:.60}, "
                    "not a text or a number"
                )
        return [(p, str(a)) for p, a in zip(prompts, answers, strict=True)]

    def problem(self, row: tuple[Any, str]) -> Problem:
        """A row as the policy sees it: the prompt (through the chat template when on)."""
        prompt, answer = row
        if self._tokenizer is not None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            if self._strip_prefix:
                prompt = prompt.removeprefix(self._strip_prefix)
        return Problem(prompt=prompt, answer=answer)

    @property
    def num_train(self) -> int:
        return len(self._train)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training rows drawn with replacement (never a held-out one)."""
        return [self.problem(rng.choice(self._train)) for _ in range(n)]

    def eval_problems(self) -> list[Problem]:
        return [self.problem(row) for row in self._eval]

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        if len(responses) != len(problems):
            raise ValueError(f"got {len(responses)} responses for {len(problems)} problems")
        return list(
            self.reward(responses, [p.answer for p in problems], [p.prompt for p in problems])
        )
