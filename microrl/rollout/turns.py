"""What ends a model turn: the chat template's own turn end, not only ``tokenizer.eos_token``
(Gemma ends turns with ``<end_of_turn>``, Llama 3 with ``<|eot_id|>``), read from the template
and joined with the eos ids (docs/rollouts.md#turn-terminators).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PLAIN_CHAT_TEMPLATE",
    "TurnEnd",
    "chat_template_of",
    "template_turn_end",
    "turn_terminators",
]

# For tokenizers without a chat template: the contents in order, an assistant turn closed by <eos>.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
# Rendered with two contents, the texts differ exactly at the content: what follows is the turn end.
PROBE_CONVERSATION = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
_OTHER_CONTENT = "z"


def chat_template_of(tokenizer: Any) -> str:
    """The tokenizer's chat template, or :data:`PLAIN_CHAT_TEMPLATE` when it has none."""
    return getattr(tokenizer, "chat_template", None) or PLAIN_CHAT_TEMPLATE


def render(tokenizer: Any, messages: list[dict], *, generation_prompt: bool) -> str:
    """``messages`` rendered by the tokenizer's chat template (:func:`chat_template_of`)."""
    return tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template_of(tokenizer),
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """A rendered text's ids (the template writes the special tokens itself)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class TurnEnd:
    """The template's turn end ``token_id`` and :data:`PROBE_CONVERSATION`'s ids up to it."""

    token_id: int
    probe_ids: list[int]


def template_turn_end(tokenizer: Any) -> TurnEnd:
    """The token the chat template writes right after an assistant message's content;
    ``ValueError`` when there is none, or it is no token of its own (it merges with the content).
    """
    other = [PROBE_CONVERSATION[0], {"role": "assistant", "content": _OTHER_CONTENT}]
    try:
        text = render(tokenizer, PROBE_CONVERSATION, generation_prompt=False)
        other_text = render(tokenizer, other, generation_prompt=False)
    except Exception as err:  # jinja's TemplateError, a template's raise_exception(...)
        raise ValueError(
            "the tokenizer's chat template fails on a plain [user, assistant] conversation "
            f"({type(err).__name__}: {err}): the end of a model turn cannot be read from it"
        ) from err
    if len(other_text) != len(text) or text == other_text:
        raise ValueError(
            "the tokenizer's chat template does not render an assistant message's content as it "
            "is: the end of a model turn cannot be found in it"
        )
    at = max(i for i in range(len(text)) if text[i] != other_text[i]) + 1  # after the content
    head, tail = encode(tokenizer, text[:at]), encode(tokenizer, text[at:])
    full = encode(tokenizer, text)
    if not tail:
        raise ValueError(
            "the tokenizer's chat template writes nothing after an assistant turn: a model turn "
            "could not be told apart from what follows it"
        )
    if full[: len(head) + 1] != [*head, tail[0]]:
        raise ValueError(
            f"the tokenizer's chat template ends an assistant turn with {text[at:]!r}, which is "
            "not a token of its own after the content: a model turn's end could not be told "
            "apart from the turn"
        )
    return TurnEnd(token_id=tail[0], probe_ids=full[: len(head) + 1])


def turn_terminators(
    tokenizer: Any, generation_config: Any = None, *, require_template: bool = True
) -> tuple[int, ...]:
    """Every id that ends a model turn, once each: the template's turn end, the tokenizer's
    ``eos_token_id`` and ``generation_config.eos_token_id`` (None, an int or a list).

    ``ValueError`` for a ``generation_config.eos_token_id`` that is not this tokenizer's ids,
    and with ``require_template`` (episodes need it) for a template without a turn end.
    """
    try:
        stops = [template_turn_end(tokenizer).token_id, tokenizer.eos_token_id]
    except ValueError:
        if require_template:
            raise
        stops = [tokenizer.eos_token_id]
    extra = getattr(generation_config, "eos_token_id", None)
    if extra is not None:
        extra = [extra] if isinstance(extra, int) else extra
        vocab = len(tokenizer)
        if (
            isinstance(extra, str)
            or not isinstance(extra, Sequence)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in extra)
            or not all(0 <= t < vocab for t in extra)
        ):
            raise ValueError(
                "the model's generation_config.eos_token_id must be a token id or a list of "
                f"them in [0, {vocab}), got {generation_config.eos_token_id!r}"
            )
        stops.extend(extra)
    return tuple(dict.fromkeys(t for t in stops if t is not None))
