"""Streamed text (microrl/agents/detokenizer.py): characters whose UTF-8 bytes span tokens are
given out whole, never as U+FFFD, and the deltas spell exactly the whole turn's text."""

from __future__ import annotations

import pytest
from agent_utils import byte_tokenizer, chat_tokenizer

from microrl.agents.detokenizer import IncrementalDetokenizer, stream_pieces

# 2-, 3- and 4-byte characters, a skin-tone modifier (two code points), and them combined.
SPLIT = ["café!", "日本語で", "👍🏽 ok", "a日👍é\n末"]


@pytest.mark.parametrize("text", SPLIT)
def test_deltas_hold_back_unfinished_characters_and_spell_the_text(text):
    tokenizer = byte_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text)  # some character spans several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(i) for i in ids]
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    first = len(text[0].encode())  # the first character's tokens: held back until complete
    assert deltas[: first - 1] == [""] * (first - 1) and deltas[first - 1] == text[0]


def test_pieces_are_the_content_even_where_it_is_not_the_tokens_text():
    tokenizer = chat_tokenizer()
    eos = tokenizer.eos_token_id
    ids = [*tokenizer(" 12 ab", add_special_tokens=False)["input_ids"], eos]
    assert stream_pieces(tokenizer, ids, " 12 ab") == [" ", "12", " ", "a", "b"]
    assert "".join(stream_pieces(tokenizer, ids, "12 ab")) == "12 ab"  # stripped by a parser
    cut = byte_tokenizer()("日", add_special_tokens=False)["input_ids"][:2]  # cut mid-character
    text = byte_tokenizer().decode(cut)
    assert "".join(stream_pieces(byte_tokenizer(), cut, text)) == text
