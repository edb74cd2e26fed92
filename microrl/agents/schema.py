"""The agent endpoint's requests as pydantic models: every field it reads, checked up front.

A request is validated whole before anything is sampled or recorded (docs/rollouts.md#agents),
so a malformed call is a 400 naming its field (``param``, e.g. ``messages[2].role``) and leaves
no trace in the episode's rows. Types are strict, as OpenAI's API checks them: ``"0.7"`` is
not a temperature, ``1.0`` not a token count, ``true`` neither. Fields the endpoint does not
know are ignored, as vLLM's server does: agent frameworks send many (``metadata``, ``store``,
...). Which values the run can honour (its own temperature, ``n=1``, ...) is the endpoint's
check, after this one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

__all__ = ["ChatRequest", "CompletionRequest", "RequestError", "validate_request"]


_OBJECT = re.compile(r"a valid dictionary or instance of \w+")


class RequestError(ValueError):
    """A request that does not fit its schema: ``param`` names the field (None: the body)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class _Strict(BaseModel):
    # extra="allow": unknown fields pass (and are ignored), as vLLM's server lets them.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _content(value: Any) -> Any:
    """A message's content: a text, a list of text parts, or null (no images, no audio)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "should be a text or a list of text parts")
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise PydanticCustomError("content_part", "only text parts are supported")
        if not isinstance(part.get("text"), str):
            raise PydanticCustomError("content_part", "a text part's text should be a text")
    return value


def _texts(value: Any) -> Any:
    """``stop``: a text or a list of texts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise PydanticCustomError("stop_type", "should be a text or a list of texts")


def _arguments(value: Any) -> Any:
    """A tool call's arguments: OpenAI's JSON text, or the object itself."""
    if isinstance(value, str | dict):
        return value
    raise PydanticCustomError("arguments_type", "should be a JSON text (or an object)")


def _prompt(value: Any) -> str:
    """A completions prompt: a non-empty text, or a batch of one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str) and value:
        return value
    raise PydanticCustomError("prompt", "should be a non-empty text (or a list of one)")


def _tool_choice(value: Any) -> Any:
    if value in (None, "none", "auto", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return value
    raise PydanticCustomError(
        "tool_choice", "should be 'none', 'auto', 'required' or {'function': {'name': ...}}"
    )


Content = Annotated[Any, AfterValidator(_content)]
Texts = Annotated[Any, AfterValidator(_texts)]
Count = Annotated[int, Field(ge=1)]
Number = float  # strict and finite (the model config): an int is a number, a bool is not


class FunctionCall(_Strict):
    name: str
    arguments: Annotated[Any, AfterValidator(_arguments)] = None


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: Function


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Sampling(_Strict):
    """The fields both routes share."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    n: Count | None = None
    stop: Texts = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatRequest(_Sampling):
    """``POST .../v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice)] = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    """``POST .../v1/completions``: one text prompt (or a batch of one)."""

    prompt: Annotated[Any, AfterValidator(_prompt)]
    best_of: Count | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None


def validate_request(model: type[_Strict], body: Any) -> Any:
    """``body`` (a parsed JSON request) as ``model``; :class:`RequestError` naming the first
    field that does not fit, and what it should be."""
    if not isinstance(body, Mapping):
        raise RequestError(f"the request body must be a JSON object, got {_short(body)}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        path = _path(body, errors[0])
        why = []  # a union's members each say what they expected
        for error in errors:
            message = _OBJECT.sub("a JSON object", error["msg"])
            if _path(body, error) == path and message not in why:
                why.append(message)
        param = _param(path)
        got = "" if errors[0]["type"] == "missing" else f", got {_short(_at(body, path))}"
        raise RequestError(f"{param}: {' or '.join(why)}{got}", param) from None


def _path(body: Any, error: Mapping) -> list:
    """The part of pydantic's ``loc`` that is a path in the data (the rest names union
    members and validators), with a missing field's name."""
    path, value, loc = [], body, error["loc"]
    for depth, key in enumerate(loc):
        if _has(value, key):
            value = value[key]
        elif error["type"] == "missing" and depth == len(loc) - 1:
            return [*path, key]
        else:
            break
        path.append(key)
    return path


def _has(value: Any, key: Any) -> bool:
    if isinstance(value, Mapping):
        return key in value
    return isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value)


def _param(path: list) -> str:
    """OpenAI's ``param`` for a path: ``messages[2].tool_calls[0].function``."""
    text = ""
    for key in path:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text


def _at(body: Any, path: list) -> Any:
    value = body
    for key in path:
        value = value[key]
    return value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
