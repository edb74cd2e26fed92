"""Streamed text (microrl/agents/detokenizer.py): characters whose UTF-8 bytes span tokens are
given out whole, never as U+FFFD, and the deltas spell exactly the whole turn's text."""

from __future__ import annotations

import pytest
from agent_utils import byte_tokenizer, chat_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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


def test_a_sentencepiece_style_decode_keeps_its_spaces_and_byte_fallback():
    """Llama 2's decoder drops the space of a leading ``▁``: a token decoded alone loses it; the
    window of ids before it gives it back. Byte-fallback tokens (``<0xC3>``) split ``é``."""
    pieces = ["<unk>", "▁", *"abcd", "<0xC3>", "<0xA9>"]
    model = models.BPE(
        {p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    ids = tokenizer("ab cé d", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[3:5]) == "c"  # alone, "▁c" has no space
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push(i) for i in ids] == ["", "a", "b", " ", "c", "", "é", " ", "d"]


def test_pieces_are_the_content_even_where_it_is_not_the_tokens_text():
    tokenizer = chat_tokenizer()
    eos = tokenizer.eos_token_id
    ids = [*tokenizer(" 12 ab", add_special_tokens=False)["input_ids"], eos]
    assert stream_pieces(tokenizer, ids, " 12 ab") == [" ", "12", " ", "a", "b"]
    assert "".join(stream_pieces(tokenizer, ids, "12 ab")) == "12 ab"  # stripped by a parser
    cut = byte_tokenizer()("日", add_special_tokens=False)["input_ids"][:2]  # cut mid-character
    text = byte_tokenizer().decode(cut)
    assert "".join(stream_pieces(byte_tokenizer(), cut, text)) == text
