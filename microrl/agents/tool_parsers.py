"""Tool calls in a model's text, parsed into OpenAI ``tool_calls`` (docs/rollouts.md#tool-parsers).

``make_tool_parser(name, tokenizer)`` gives a :class:`ToolCallParser`: with vLLM installed, a name
vLLM's ``ToolParserManager`` knows (``hermes``, ``qwen3_xml``, ``llama3_json``, ...) runs vLLM's
own parser, the one ``vllm serve --tool-call-parser`` runs; without vLLM, ``hermes`` (the
Qwen2.5/Qwen3 ``<tool_call>{json}</tool_call>`` format) is built in. A malformed call never
raises: the whole text comes back as plain content with ``error`` saying why, so the agent sees
what the model wrote and the caller counts it (``agent/tool_parse_errors``). A parser whose
``skip_special_tokens`` is False reads the turn's text with its special tokens (some tokenizers
mark ``<tool_call>`` special, and decoding would drop it), as ``vllm serve`` gives it to vLLM's.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BUILT_IN_PARSERS",
    "HermesParser",
    "ParsedCall",
    "ToolCallParser",
    "VLLMToolParser",
    "as_parsed_call",
    "known_parsers",
    "make_tool_parser",
]


@dataclass(frozen=True)
class ParsedCall:
    """One model turn parsed: its text outside the calls (None when there is none), the calls in
    OpenAI format (``{"id", "type": "function", "function": {"name", "arguments": json str}}``),
    and ``error`` (None, or why the calls were malformed: then ``content`` is the whole text)."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    error: str | None = None


@runtime_checkable
class ToolCallParser(Protocol):
    """Parses a finished turn's text; ``tools`` are the request's (OpenAI format) or None.

    ``parse`` returns a :class:`ParsedCall` or a ``(content, tool_calls, error)`` tuple
    (:func:`as_parsed_call`). An optional ``skip_special_tokens = False`` attribute asks for
    the text with its special tokens (its terminator excepted); absent, they are dropped.
    """

    name: str

    def parse(self, text: str, tools: list[dict] | None) -> ParsedCall: ...


def as_parsed_call(result: Any) -> ParsedCall:
    """A parser's result as a :class:`ParsedCall`: one already, or the ``(content, tool_calls,
    error)`` tuple the protocol allows. ``TypeError`` for anything else."""
    if isinstance(result, ParsedCall):
        return result
    if isinstance(result, tuple) and len(result) == 3:
        content, calls, error = result
        calls = [] if calls is None else calls
        texts = all(value is None or isinstance(value, str) for value in (content, error))
        if texts and isinstance(calls, list) and all(isinstance(c, dict) for c in calls):
            return ParsedCall(content, list(calls), error)
    raise TypeError(
        "a tool parser's parse(text, tools) must return a ParsedCall or a (content: str | None, "
        f"tool_calls: list[dict], error: str | None) tuple, got {_short(result)}"
    )


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _tool_names(tools: Sequence[Mapping] | None) -> set[str] | None:
    """The names ``tools`` declare (None: no tools given, any name goes)."""
    if not tools:
        return None
    if isinstance(tools, str | Mapping) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of OpenAI tool dicts, got {type(tools).__name__}")
    names = set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TypeError(
                "tools must be OpenAI tool dicts {'type': 'function', 'function': {'name', ...}}, "
                f"got {tool!r}"
            )
        names.add(function["name"])
    return names


def _failed(text: str, why: str) -> ParsedCall:
    return ParsedCall(content=text, tool_calls=[], error=why)


def _content(text: str) -> str | None:
    return text.strip() or None


# OpenAI's rule for function names (and a dot): a name with spaces or tags is a parser's misread.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _check_calls(calls: list[dict], names: set[str] | None) -> str | None:
    """Why ``calls`` are not usable (None: they are): a name that is not a function name or not
    among ``names``, arguments that are not a JSON object."""
    for call in calls:
        name = call["function"]["name"]
        if not _FUNCTION_NAME.fullmatch(name):
            return f"the model called {name!r}, which is not a function name"
        if names is not None and name not in names:
            return f"the model called {name!r}, which is not one of the tools {sorted(names)}"
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError as err:
            return f"the arguments of {name!r} are not JSON: {err}"
        if not isinstance(arguments, dict):
            return f"the arguments of {name!r} are not a JSON object: {arguments!r}"
    return None


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them, with text
    around them (Hermes 2 Pro, Qwen2.5, Qwen3 and QwQ's templates).

    ``content`` is the text outside the calls, stripped (vLLM's ``hermes`` keeps the text before
    the first call only). Malformed: a body that is not a JSON object with a string ``name`` and
    an object ``arguments`` (e.g. Qwen3-Coder's ``<function=...>`` XML inside the tags), a tag
    left open or closed without opening, a name not among ``tools``.
    """

    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    skip_special_tokens = False  # as vLLM's hermes: some tokenizers mark the tags special

    def parse(self, text: str, tools: list[dict] | None) -> ParsedCall:
        names = _tool_names(tools)
        if self.start not in text and self.end not in text:
            return ParsedCall(content=_content(text))
        calls, outside, position = [], [], 0
        while (start := text.find(self.start, position)) != -1:
            outside.append(text[position:start])
            body_start = start + len(self.start)
            stop = text.find(self.end, body_start)
            if stop == -1:
                return _failed(text, f"a {self.start} is never closed by {self.end}")
            body = text[body_start:stop]
            if self.start in body:
                return _failed(text, f"a {self.start} opens inside another one")
            call = self._call(body)
            if isinstance(call, str):
                return _failed(text, call)
            calls.append(call)
            position = stop + len(self.end)
        outside.append(text[position:])
        if any(self.end in piece for piece in outside):
            return _failed(text, f"a {self.end} closes no {self.start}")
        why = _check_calls(calls, names)
        if why is not None:
            return _failed(text, why)
        return ParsedCall(content=_content("".join(outside)), tool_calls=calls)

    @staticmethod
    def _call(body: str) -> dict | str:
        """The OpenAI call in a tag's body, or why there is none."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError as err:
            return f"a tool call is not JSON ({err}): {body.strip()[:80]!r}"
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return f"a tool call is not a JSON object with a string 'name': {body.strip()[:80]!r}"
        arguments = value.get("arguments")
        if not isinstance(arguments, dict):
            return f"the 'arguments' of a call to {value['name']!r} are not a JSON object"
        return {
            "id": new_call_id(),
            "type": "function",
            # json.dumps' separators, as vLLM's: the agent sends them back, the template renders them
            "function": {"name": value["name"], "arguments": json.dumps(arguments)},
        }


class VLLMToolParser:
    """vLLM's parser ``name`` (``ToolParserManager``), run on a finished turn's text.

    vLLM's parsers take an OpenAI request; a minimal ``ChatCompletionRequest`` carries the tools.
    The wrapper adds what vLLM does not check, so that a malformed call is one whatever the
    parser: a parser that raises, finds no call in text with its start tag, drops text, leaves
    a start tag unclosed (vLLM's ``hermes`` accepts a last call whose closing tag never came),
    names no function or one not in ``tools``, or writes arguments that are not a JSON object,
    gives the whole text back with ``error``.
    """

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        self.tokenizer = tokenizer
        self.parser_class = ToolParserManager.get_tool_parser(name)
        # vLLM logs a traceback for every malformed call; they are counted here instead.
        logging.getLogger(self.parser_class.__module__).setLevel(logging.CRITICAL)
        if tokenizer is not None:  # a parser that cannot read it is refused now, not per turn
            _ = self.skip_special_tokens

    @functools.cached_property
    def skip_special_tokens(self) -> bool:
        """Whether vLLM decodes a request with tools for this parser without special tokens
        (its ``adjust_request`` says); building the parser checks that it reads the tokenizer."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        request = ChatCompletionRequest(model="microrl", messages=[], tools=[tool])
        try:
            parser = self.parser_class(self.tokenizer, request.tools)
        except Exception as err:  # e.g. a start token the tokenizer lacks
            raise ValueError(
                f"vLLM's {self.name} parser cannot read this tokenizer's tool calls: {err}"
            ) from err
        return bool(parser.adjust_request(request).skip_special_tokens)

    def parse(self, text: str, tools: list[dict] | None) -> ParsedCall:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        names = _tool_names(tools)
        request = ChatCompletionRequest(model="microrl", messages=[], tools=tools or None)
        parser = self.parser_class(self.tokenizer, request.tools)  # stateful: one per turn
        try:
            result = parser.extract_tool_calls(text, request)
        except Exception as err:  # a parser bug on odd text is a malformed call, not a crash
            return _failed(text, f"vLLM's {self.name} parser raised {type(err).__name__}: {err}")
        start = getattr(parser, "tool_call_start_token", None)
        end = getattr(parser, "tool_call_end_token", None)
        if start and end and text.count(start) != text.count(end):
            return _failed(text, f"a {start} is not closed by a {end}")
        if not result.tools_called or not result.tool_calls:
            if start and start in text:
                return _failed(text, f"vLLM's {self.name} parser found no valid call after {start}")
            if (result.content or "") != text:
                return _failed(text, f"vLLM's {self.name} parser found no call but dropped text")
            return ParsedCall(content=_content(text))
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in result.tool_calls
        ]
        why = _check_calls(calls, names)
        if why is not None:
            return _failed(text, why)
        return ParsedCall(content=_content(result.content or ""), tool_calls=calls)


#: Parsers that need nothing beyond the standard library.
BUILT_IN_PARSERS: dict[str, type[HermesParser]] = {"hermes": HermesParser}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def known_parsers() -> list[str]:
    """Every name :func:`make_tool_parser` takes here: the built-in ones, and vLLM's."""
    names = set(BUILT_IN_PARSERS)
    if vllm_available():
        from vllm.tool_parsers import ToolParserManager

        names.update(ToolParserManager.list_registered())
    return sorted(names)


def make_tool_parser(name: str, tokenizer: Any, *, prefer_vllm: bool = True) -> ToolCallParser:
    """The tool-call parser ``name`` for a model with ``tokenizer``.

    vLLM's parser of that name when vLLM is installed (and ``prefer_vllm``), else the built-in
    one. Raises ``ValueError`` listing the known names for an unknown one.
    """
    if not isinstance(name, str):
        raise TypeError(f"the tool parser name must be a str, got {type(name).__name__}")
    if prefer_vllm and vllm_available():
        from vllm.tool_parsers import ToolParserManager

        if name in ToolParserManager.list_registered():
            return VLLMToolParser(name, tokenizer)
    if name in BUILT_IN_PARSERS:
        return BUILT_IN_PARSERS[name]()
    raise ValueError(
        f"unknown tool parser {name!r}; known here: {', '.join(known_parsers())}"
        + ("" if vllm_available() else " (install vLLM for its parsers)")
    )
