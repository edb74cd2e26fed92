"""Streamed text of a sampled turn: never half a character, and exactly the whole turn's text.

A byte-level BPE tokenizer (GPT-2, Qwen, Llama 3) may split one character's UTF-8 bytes over
several tokens (CJK text, emoji): the text of a prefix of the ids then ends in U+FFFD until the
character's last byte arrives. :class:`IncrementalDetokenizer` holds such text back, as vLLM's
and transformers' streaming detokenizers do, and decodes a short window of ids per token (the
ids since the last text given out, after those before it, whose text is cut off again) so a
turn costs linear time and a tokenizer that drops a leading space at the start of a decode
(SentencePiece) still gives it. :func:`stream_pieces` cuts a reply's text into such deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDetokenizer", "stream_pieces"]

_REPLACEMENT = "\ufffd"  # what a decode gives for the bytes of an unfinished character


class IncrementalDetokenizer:
    """The text each new token adds (:meth:`push`), held back while it ends in an unfinished
    character; the pushed deltas concatenated are the decode of the ids pushed so far, less
    any held-back end."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # the window's start: ids whose text is context only
        self._read = 0  # ids whose text has been given out

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while it ends in an unfinished character)."""
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) <= len(before) or text.endswith(_REPLACEMENT) or not text.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]


def stream_pieces(
    tokenizer: Any, ids: Sequence[int], text: str, *, skip_special_tokens: bool = True
) -> list[str]:
    """``text`` (the reply's content, decoded from ``ids``) as streamed deltas: one per token
    that completes text, while they spell ``text``'s start; the rest as one last piece. Joined,
    the pieces are exactly ``text`` (a reply the agent sends back must match the one recorded)."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces, shown = [], 0
    for token_id in ids:
        delta = detokenizer.push(token_id)
        if not delta:
            continue
        if not text.startswith(delta, shown):
            break  # the content is not the tokens' text (e.g. stripped): send the rest at once
        pieces.append(delta)
        shown += len(delta)
    if shown < len(text):
        pieces.append(text[shown:])
    return pieces
