"""A task from the user's own prompts: JSONL or Parquet rows (or a Hub dataset) with a prompt and
an answer.

Each row of the file holds a prompt and its reference answer in the configured fields; its other
fields go to the reward functions as keyword arguments named after them (as TRL does)::

    {"prompt": "Tom has 3 apples and gets 4 more. How many apples now?", "answer": "7"}

``train_file`` (and ``eval_file``) may instead name a dataset on the Hugging Face Hub
(``org/name``, not a local path): it is loaded with ``datasets.load_dataset(name, config,
split=...)``.

The held-out prompts of the greedy accuracy are ``eval_file``'s first ``eval_size`` rows, or, with
no ``eval_file``, ``eval_size`` rows held out of ``train_file`` by a seeded shuffle (never trained
on). With ``chat_template`` the prompt (a string, taken as one user message, or a list of
``{"role", "content"}`` messages) is rendered by the tokenizer's chat template with the generation
prompt appended. With ``image_field`` each row's images (a path, URL or bytes per cell, or a list of
them; :mod:`microrl.tasks.images`) are read at load time into :attr:`Problem.images`, one per image
placeholder of its prompt. Responses are scored by a :class:`~microrl.tasks.rewards.Reward` (reward
functions given by import path, weighted). Files are read with ``datasets.load_dataset``
(docs/tasks.md).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from microrl.hub import download_hint, first_line, is_hub_name
from microrl.tasks.base import Problem, answers_for
from microrl.tasks.images import ImageLoader, count_placeholders, mark_images
from microrl.tasks.rewards import Reward, RewardFn, score_problems

__all__ = ["DatasetTask", "check_utf8", "read_rows"]

Row = tuple[Any, str, dict[str, Any], tuple]  # prompt, answer as text, other columns, images

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_rows(
    path: str | Path,
    key: str = "task.dataset.train_file",
    *,
    config: str | None = None,
    split: str = "train",
) -> Any:
    """The rows of a ``.jsonl``/``.json``/``.parquet`` file, or of split ``split`` of a Hugging
    Face Hub dataset (``config`` its subset), as a ``datasets.Dataset``; a missing or unreadable
    file or dataset is a ``ValueError`` naming ``key``."""
    name = str(path)
    path = Path(path).expanduser()
    if path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"{key}={str(path)!r} must be a .jsonl, .json or .parquet file, got {path.suffix!r}"
            )
        if builder == "json":  # pyarrow reads bad bytes now and fails on first use, unnamed
            check_utf8(path, key)
        return _load_dataset(key, str(path), builder, data_files=str(path), split="train")
    if path.suffix.lower() not in _BUILDERS and is_hub_name(name):
        return _load_dataset(key, name, name, name=config, split=split)
    raise ValueError(
        f"{key}={name!r} does not exist (a local .jsonl, .json or .parquet file, or a "
        "Hugging Face Hub dataset name)"
    )


def check_utf8(path: Path, key: str) -> None:
    """``ValueError`` naming ``key``, the file, the line and the byte offset of the first byte
    of ``path`` that is not UTF-8 (JSON text is UTF-8; a file read line by line, never whole)."""
    offset = 0
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{key}={str(path)!r} is not UTF-8 text: line {number} has byte "
                    f"0x{line[err.start]:02x} at byte offset {offset + err.start} of the file "
                    f"(byte {err.start} of the line; {err.reason}); re-encode the file as UTF-8 "
                    "(e.g. `iconv -f latin1 -t utf-8`)"
                ) from None
            offset += len(line)


def _load_dataset(key: str, shown: str, path: str, **kwargs: Any) -> Any:
    """``datasets.load_dataset(path, **kwargs)``: a file's builder (``json``, ``parquet``) with
    ``data_files``, or a Hub dataset's name; an error names ``key``."""
    import datasets  # imported on use: it is a heavy import the built-in tasks do not need

    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one file's "Generating train split" bar is noise here
    try:
        return datasets.load_dataset(path, **kwargs)
    except Exception as err:
        if "data_files" in kwargs:
            what, hint = f"could not be read as {path}", ""
        else:
            what = (
                f"could not be loaded from the Hugging Face Hub (config {kwargs['name']!r}, split "
                f"{kwargs['split']!r})"
            )
            hint = (
                "; check the name, task.dataset.config and the split, or download it with "
                f"{download_hint(shown, 'dataset')} and give its files"
            )
        raise ValueError(f"{key}={shown!r} {what}: {first_line(err)}{hint}") from err
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _column(rows: Any, field: str, key: str, path: str) -> list:
    if field not in rows.column_names:
        raise ValueError(
            f"{key}={field!r} is not a field of {path} (its fields: {', '.join(rows.column_names)})"
        )
    return list(rows[field])


def _is_blank(prompt: str | list[dict]) -> bool:
    """Whether a prompt (a text, or chat messages) holds no text but whitespace: with no BOS
    token it encodes to no token at all, and a response then starts at the row's first
    position, which nothing predicts; under a chat template it is a question never asked."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return all(_is_blank_content(m["content"]) for m in prompt)


def _is_blank_content(content: Any) -> bool:
    """A message's content: a text, or a list of parts (``{"type": "text", "text": ...}``; a
    part of another type, an image, is content)."""
    if content is None or isinstance(content, str):
        return not (content or "").strip()
    if isinstance(content, list):
        return all(
            isinstance(part, dict)
            and part.get("type") == "text"
            and not str(part.get("text") or "").strip()
            for part in content
        )
    return False


def _text_bytes(prompt: str | list[dict]) -> int:
    """The UTF-8 bytes of a prompt's text (a message list's string contents summed)."""
    if isinstance(prompt, str):
        return len(prompt.encode())
    return sum(len(m["content"].encode()) for m in prompt if isinstance(m["content"], str))


class DatasetTask:
    """Prompts and answers from a file, scored by ``reward(completions, answers, prompts,
    **other_columns)``.

    Args:
        train_file: ``.jsonl``, ``.json`` or ``.parquet`` file of training rows, or the name of
            a Hugging Face Hub dataset.
        reward: a :class:`~microrl.tasks.rewards.Reward` (import paths, weights), or one reward
            function ``fn(completions, answers=..., prompts=..., **columns) -> list[float]``;
            ``None`` for prompts scored elsewhere (an environment's rewards, ``task.name=env``).
        eval_file: the held-out rows; ``None`` holds ``eval_size`` rows out of ``train_file``.
        dataset_config, train_split, eval_split: a Hub dataset's config (subset) and the splits
            of ``train_file`` and ``eval_file`` (files have one split: theirs).
        eval_size: held-out prompts (of ``eval_file``: its first ``eval_size`` rows, or all).
        seed: seed of the held-out split.
        prompt_field, answer_field: the fields of a row that hold the prompt and the answer.
        chat_template: render each prompt with ``tokenizer``'s chat template.
        tokenizer: the policy's tokenizer (needed for ``chat_template`` only).
        solved_threshold: a held-out response counts as solved at a reward >= this.
        image_field: the field holding each row's image (or list of images): a path (relative
            to the data file), a ``file://`` or ``http(s)://`` URL, or bytes; ``None``: text only.
        image_marker: a text the prompts write where an image goes (``"<image>"`` in
            LLaVA-style datasets), replaced by :data:`~microrl.tasks.images.IMAGE_PLACEHOLDER`.
    """

    def __init__(
        self,
        train_file: str | Path,
        reward: Reward | RewardFn | None,
        *,
        eval_file: str | Path | None = None,
        eval_size: int = 200,
        seed: int = 0,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        chat_template: bool = False,
        tokenizer: Any = None,
        solved_threshold: float = 1.0,
        dataset_config: str | None = None,
        train_split: str = "train",
        eval_split: str = "test",
        image_field: str | None = None,
        image_marker: str | None = None,
    ) -> None:
        if eval_size < 1:
            raise ValueError(f"task.eval_size must be >= 1, got {eval_size}")
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "task.dataset.chat_template=true needs a tokenizer with a chat template; the model's "
                "tokenizer has none (set task.dataset.chat_template=false, or use a checkpoint whose "
                "tokenizer_config.json or chat_template.jinja defines one)"
            )
        # A plain function gets the keyword handling and checks of a configured reward.
        self.reward = reward if reward is None or isinstance(reward, Reward) else Reward([reward])
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
        self._image_field = image_field
        self._image_marker = image_marker
        self._images_loader = ImageLoader()  # shared by both files: a URL is fetched once
        self._dataset_config = dataset_config
        train = self._load(train_file, "task.dataset.train_file", train_split)
        if eval_file is None:
            if not eval_size < len(train):
                raise ValueError(
                    f"task.eval_size must be below the {len(train)} rows of task.dataset.train_file="
                    f"{str(train_file)!r} (it holds the held-out rows out of them; or give "
                    f"task.dataset.eval_file), got {eval_size}"
                )
            order = list(range(len(train)))
            random.Random(seed).shuffle(order)
            self._eval = [train[i] for i in order[:eval_size]]
            self._train = [train[i] for i in order[eval_size:]]
        else:
            self._train = train
            self._eval = self._load(eval_file, "task.dataset.eval_file", eval_split)[:eval_size]
        self.problem(self._train[0])  # a chat template that fails, fails now

    def _load(self, path: str | Path, key: str, split: str) -> list[Row]:
        rows = read_rows(path, key, config=self._dataset_config, split=split)
        if len(rows) == 0:
            raise ValueError(f"{key}={str(path)!r} has no rows")
        prompt_field, answer_field = self._fields
        prompts = _column(rows, prompt_field, "task.dataset.prompt_field", str(path))
        answers = _column(rows, answer_field, "task.dataset.answer_field", str(path))
        for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
            is_messages = isinstance(prompt, list) and all(
                isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt
            )
            if not (isinstance(prompt, str) or (is_messages and self._tokenizer is not None)):
                rule = "a string" + (
                    " or a list of {role, content} messages" * bool(self._tokenizer)
                )
                raise ValueError(
                    f"task.dataset.prompt_field={prompt_field!r}: row {i} of {path} holds "
                    f"{type(prompt).__name__} {prompt!r:.60}, not {rule}"
                )
            if _is_blank(prompt):  # nothing to continue: a row the loss cannot train on
                raise ValueError(
                    f"task.dataset.prompt_field={prompt_field!r}: row {i} of {path} holds an empty "
                    f"prompt ({prompt!r:.60}); every row needs a prompt with some text: fill "
                    "it or remove the row"
                )
            if answer is None or isinstance(answer, (list, dict)):
                raise ValueError(
                    f"task.dataset.answer_field={answer_field!r}: row {i} of {path} holds {answer!r:.60}, "
                    "not a text or a number"
                )
        others = [c for c in rows.column_names if c not in (prompt_field, self._image_field)]
        columns = [
            dict(zip(others, values, strict=True))
            for values in zip(*(rows[c] for c in others), strict=True)
        ]
        if self._image_marker:
            prompts = [mark_images(p, self._image_marker) for p in prompts]
        images = self._images(rows, prompts, path) if self._image_field else [()] * len(prompts)
        return [
            (p, str(a), c, i) for p, a, c, i in zip(prompts, answers, columns, images, strict=True)
        ]

    def _images(self, rows: Any, prompts: list, path: str | Path) -> list[tuple]:
        """Every row's images, read now: a missing or unreadable image, or a prompt whose image
        placeholders do not match its images, is a ``ValueError`` naming the row and the field."""
        field = self._image_field
        cells = _column(rows, field, "task.images.field", str(path))
        local = Path(path).expanduser()
        base = local.parent if local.is_file() else Path.cwd()
        out = []
        for i, (cell, prompt) in enumerate(zip(cells, prompts, strict=True)):
            where = f"task.images.field={field!r}: row {i} of {path}"
            values = cell if isinstance(cell, list) else [] if cell is None else [cell]
            try:
                images = tuple(self._images_loader.load(value, base) for value in values)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from err
            slots = count_placeholders(prompt)
            if slots != len(images):
                raise ValueError(
                    f"{where} has {len(images)} image(s) but its prompt has {slots} image "
                    "placeholder(s) (<|image_pad|>, one per image, in order)"
                )
            out.append(images)
        return out

    def problem(self, row: Row) -> Problem:
        """A row as the policy sees it: the prompt (through the chat template when on) and the
        row's other columns."""
        prompt, answer, columns, images = row
        if self._tokenizer is not None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            if self._strip_prefix:
                prompt = prompt.removeprefix(self._strip_prefix)
        return Problem(prompt=prompt, answer=answer, columns=columns, images=images)

    def longest_problems(self, n: int) -> list[Problem]:
        """The ``n`` rows (training and held-out) with the most prompt text, in UTF-8 bytes (a
        message list's contents summed), as the policy sees them: the rows whose token count
        is the largest, found without tokenizing every row (checks at start)."""
        rows = [*self._train, *self._eval]
        size = [_text_bytes(prompt) for prompt, *_ in rows]
        longest = sorted(range(len(rows)), key=size.__getitem__, reverse=True)[:n]
        return [self.problem(rows[i]) for i in longest]

    @property
    def num_train(self) -> int:
        return len(self._train)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training rows drawn with replacement (never a held-out one)."""
        return [self.problem(rng.choice(self._train)) for _ in range(n)]

    def eval_problems(self) -> list[Problem]:
        return [self.problem(row) for row in self._eval]

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        answers_for(responses, problems)  # the counts first: a ValueError before the TypeError
        if self.reward is None:
            raise TypeError("this DatasetTask has no reward: its prompts are scored elsewhere")
        return score_problems(self.reward, responses, problems)
