"""What the agent endpoint reads and writes: request bodies, and OpenAI's replies, errors and
Server-Sent Events.

Every error the endpoint answers, aiohttp's routing ones included, has OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``), so the ``openai`` client raises with the
message and the field (docs/rollouts.md#agents).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from aiohttp import web

__all__ = [
    "Refused",
    "chunk",
    "envelope",
    "error_response",
    "read_json",
    "sse",
    "sse_done",
    "sse_start",
    "usage",
]


class Refused(Exception):
    """A request the endpoint refuses: the HTTP ``status``, OpenAI's ``param`` (the field at
    fault, or None) and ``code`` (e.g. ``context_length_exceeded``, or None)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, param=self.param, code=self.code)


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """OpenAI's error body: ``type`` is ``invalid_request_error`` for a 4xx, else
    ``server_error``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, decoded with its charset (UTF-8 by default). A body past the app's
    ``client_max_size`` raises aiohttp's 413; one that is no text or no JSON is refused (400),
    including JSON nested too deeply for Python's parser or an integer too long for ``int``."""
    raw = await request.read()
    charset = request.charset or "utf-8"
    try:
        text = raw.decode(charset)
    except LookupError:
        raise Refused(400, f"the Content-Type's charset {charset!r} is unknown") from None
    except UnicodeDecodeError as err:
        raise Refused(400, f"the request body is not {charset} text: {err}") from None
    try:
        return json.loads(text, parse_int=_int)
    except RecursionError:
        raise Refused(400, "the request body's JSON is nested too deeply") from None
    except ValueError as err:  # json.JSONDecodeError among them
        raise Refused(400, f"the request body is not JSON: {err}") from None


def _int(text: str) -> int | float:
    """A JSON integer; one past Python's digit limit (4300) as the float it is close to (inf
    when past its range), which no integer field accepts, so the schema names the field."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def envelope(kind: str, model: str, choice: dict, usage: dict | None) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    body = {
        "id": f"{prefix}-{secrets.token_hex(8)}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        body["usage"] = usage
    return body


def chunk(model: str, delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return envelope("chat.completion.chunk", model, choice, None)


async def sse_start(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


async def sse(response: web.StreamResponse, data: dict) -> None:
    await response.write(f"data: {json.dumps(data)}\n\n".encode())


async def sse_done(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
