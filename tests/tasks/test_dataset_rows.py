"""Rows of a prompt file refused at load, naming the file and the row: empty prompts, bytes
that are not UTF-8; and the longest prompt checked against the model's positions at start.

Before, an empty prompt trained silently (chat template) or failed steps later with the
engine's ``loss_mask`` error (no template, no BOS), and a bad byte surfaced as a bare
``UnicodeDecodeError`` when a column was first read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import LlamaConfig

from microrl.run.toy_model import build_tokenizer
from microrl.tasks import DatasetTask
from microrl.tasks.rewards import exact_match
from microrl.tasks.word_problems import WORD_ALPHABET

ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)]
CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("prompt", "chat"),
    [
        ("", False),
        ("  \n", False),
        ("", True),
        ([], True),
        ([{"role": "system", "content": " "}, {"role": "user", "content": ""}], True),
        ([{"role": "user", "content": [{"type": "text", "text": ""}]}], True),
    ],
)
def test_an_empty_prompt_is_refused_naming_the_file_and_row(tmp_path, prompt, chat) -> None:
    tokenizer = build_tokenizer(WORD_ALPHABET + "<>")
    tokenizer.chat_template = CHAT
    path = _jsonl(tmp_path / "train.jsonl", [*ROWS[:3], {"prompt": prompt, "answer": "0"}])
    where = re.escape(f"task.dataset.prompt_field='prompt': row 3 of {path} holds an empty prompt")
    with pytest.raises(ValueError, match=where):
        DatasetTask(path, exact_match, eval_size=1, chat_template=chat, tokenizer=tokenizer)


def test_a_message_with_an_image_part_is_not_empty(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(WORD_ALPHABET + "<>")
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{% endfor %}"
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ""}]}]
    path = _jsonl(tmp_path / "train.jsonl", [{"prompt": image, "answer": "0"}] * 3)
    DatasetTask(path, exact_match, eval_size=1, chat_template=True, tokenizer=tokenizer)


def test_a_byte_that_is_not_utf8_is_refused_naming_the_line_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    good = "".join(json.dumps(r) + "\n" for r in ROWS[:2]).encode()
    bad = b'{"prompt": "caf\xe9 2+2=", "answer": "4"}\n'  # latin-1, not UTF-8
    path.write_bytes(good + bad + good)
    column = bad.index(b"\xe9")
    message = re.escape(
        f"task.dataset.eval_file={str(path)!r} is not UTF-8 text: line 3 has byte 0xe9 at byte offset "
        f"{len(good) + column} of the file (byte {column} of the line;"
    )
    with pytest.raises(ValueError, match=message):
        DatasetTask(_jsonl(tmp_path / "ok.jsonl", ROWS), exact_match, eval_file=path)


def test_the_longest_prompt_and_max_new_tokens_must_fit_the_models_positions(
    tmp_path, monkeypatch
) -> None:
    from microrl.run import loop

    monkeypatch.setattr(loop, "CHECKED_PROMPTS", 2)  # the rows with the most text only
    tokenizer = build_tokenizer()
    rows = [*ROWS, {"prompt": "1234567+7654321=", "answer": "8888888"}]  # 17 tokens with <bos>
    task = DatasetTask(_jsonl(tmp_path / "train.jsonl", rows), exact_match, eval_size=1)
    model = tmp_path / "model"
    LlamaConfig(max_position_embeddings=24).save_pretrained(model)
    loop.check_prompt_positions(task, tokenizer, str(model), 7)  # 17 + 7 = 24: fits
    message = (
        r"the task's longest prompt \('1234567\+7654321='\) has 17 tokens: with "
        r"rollout.max_new_tokens=8 a row reaches 25 positions, past the model's 24 "
        r"\(config.max_position_embeddings\)"
    )
    with pytest.raises(ValueError, match=message):
        loop.check_prompt_positions(task, tokenizer, str(model), 8)
