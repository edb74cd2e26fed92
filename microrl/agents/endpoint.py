"""The OpenAI-compatible HTTP endpoint agents call; it runs in the trainer process.

An aiohttp server on its own event loop, in a thread of the trainer process, serves
``/episodes/<id>/v1/chat/completions``, ``.../v1/completions`` and ``.../v1/models``. The
episode is named by the base URL the runner gives each agent's client, so agent code never knows
about it. Every call is rendered with the chat template, matched against the episode's recorded
rows (:mod:`microrl.agents.trajectories`) and sampled by the run's sampler
(:class:`~microrl.agents.sampler.BatchingSampler`). Streaming answers are Server-Sent Events.

Security (docs/rollouts.md#agents): only requests bearing the run's key (``Authorization: Bearer``)
are served, 401 otherwise; the server binds to 127.0.0.1 unless told another host. aiohttp is a
dependency because it serves SSE and many concurrent requests on one loop, without vLLM (which
brings FastAPI, and aiohttp too).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from microrl.agents.detokenizer import stream_pieces
from microrl.agents.tool_parsers import as_parsed_call
from microrl.agents.trajectories import EpisodeRecorder

__all__ = ["AgentEndpoint", "EpisodeState"]

_MAX_REQUEST_BYTES = 64 << 20


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class EpisodeState:
    """An episode's rows and counters; ``closed`` once it ended (later calls are refused)."""

    id: str
    recorder: EpisodeRecorder
    budget: int  # tokens a row may hold after the episode's first prompt
    closed: bool = False
    error: str | None = None  # why the endpoint failed it (the token budget)
    tool_calls: int = 0
    tool_parse_errors: int = 0
    first_prompt: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class AgentEndpoint:
    """Serves the episodes registered with :meth:`add_episode` (see the module docstring).

    Args:
        sampler: has ``submit(prompt_ids, max_tokens) -> Future[Turn]`` (thread-safe).
        renderer: the chat-template renderer of the policy's tokenizer.
        temperature: the run's (the loss's) temperature: a request asking another is refused
            (None: any is accepted, as in greedy evaluation, where none is sampled from).
        max_new_tokens: a call's token limit when it sets none.
        host, port: where to listen (127.0.0.1 and a free port by default).
        tool_parser: a :class:`~microrl.agents.tool_parsers.ToolCallParser` (``parse(text,
            tools)`` returns a ``ParsedCall`` or a ``(content, tool_calls, error)`` tuple),
            applied to replies of requests with ``tools`` (None: replies are content only).
        model_name: the name ``/v1/models`` lists and replies carry.
    """

    def __init__(
        self,
        sampler: Any,
        renderer: Any,
        *,
        temperature: float | None,
        max_new_tokens: int,
        host: str = "127.0.0.1",
        port: int = 0,
        tool_parser: Any = None,
        model_name: str = "microrl-policy",
    ) -> None:
        if tool_parser is not None and not callable(getattr(tool_parser, "parse", None)):
            raise TypeError("tool_parser must have a parse(text, tools) method")
        self.sampler = sampler
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.host, self.port = host, port
        self.tool_parser = tool_parser
        self.model_name = model_name
        self.api_key = secrets.token_urlsafe(32)  # fresh per endpoint: per run step
        self.episodes: dict[str, EpisodeState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AgentEndpoint:
        """Start serving on a thread of this process; returns once it listens."""
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._start_app())
            except BaseException as err:  # reported to start()'s caller
                failure.append(err)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="microrl-agent-endpoint", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise RuntimeError(f"the agent endpoint could not listen on {self.host}") from failure[
                0
            ]
        return self

    async def _start_app(self) -> None:
        # Long conversations with tools outgrow aiohttp's 1 MiB default request size.
        app = web.Application(middlewares=[self._auth], client_max_size=_MAX_REQUEST_BYTES)
        prefix = "/episodes/{episode}/v1"
        app.router.add_get(prefix + "/models", self._models)
        app.router.add_post(prefix + "/chat/completions", self._chat)
        app.router.add_post(prefix + "/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the port the OS chose for port=0

    def close(self) -> None:
        """Stop serving (idempotent); calls in flight are cancelled."""
        if self._loop is None or self._thread is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop, self._thread = None, None

    def base_url(self, episode: str) -> str:
        """The OpenAI base URL of ``episode``'s client."""
        return f"http://{self.host}:{self.port}/episodes/{episode}/v1"

    def add_episode(self, episode: str, budget: int) -> EpisodeState:
        state = EpisodeState(episode, EpisodeRecorder(self.renderer), budget)
        self.episodes[episode] = state
        return state

    def end_episode(self, episode: str) -> None:
        """Refuse ``episode``'s later calls."""
        self.episodes[episode].closed = True

    # ------------------------------------------------------------------ requests
    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            return _error(401, "missing or wrong API key", "invalid_api_key")
        try:
            return await handler(request)
        except _Refused as refused:
            return _error(refused.status, refused.message, refused.code)

    def _episode(self, request: web.Request) -> EpisodeState:
        episode = self.episodes.get(request.match_info["episode"])
        if episode is None:
            raise _Refused(404, f"no episode {request.match_info['episode']!r}")
        if episode.closed:
            raise _Refused(409, f"episode {episode.id} has ended: its calls are refused")
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "microrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        body = await _json(request)
        self._check_sampling(body)
        tools = body.get("tools") or None
        try:
            context = episode.recorder.prepare(body.get("messages") or [], tools)
        except (TypeError, ValueError) as err:
            raise _Refused(400, f"messages: {err}") from err
        turn = await self._sample(episode, context, body)
        ids, skip = self._text_ids(turn, tools)
        text = self.tokenizer.decode(ids, skip_special_tokens=skip)
        try:
            content, calls = self._parse(episode, text, tools)
        except TypeError as err:  # the parser returned no ParsedCall (or refused the tools)
            episode.recorder.release(context)
            raise _Refused(500, str(err), "server_error") from err
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        episode.recorder.record(context, turn.ids, turn.logprobs, turn.version, reply, turn.ended)
        finish = "tool_calls" if calls else ("stop" if turn.ended else "length")
        usage = _usage(len(context.prompt_ids), len(turn.ids))
        logprobs = self._logprobs(turn) if body.get("logprobs") else None
        if body.get("stream"):
            return await self._stream_chat(request, body, reply, finish, usage, ids, skip)
        choice = {"index": 0, "message": reply, "finish_reason": finish, "logprobs": logprobs}
        return web.json_response(_envelope("chat.completion", self.model_name, choice, usage))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        body = await _json(request)
        self._check_sampling(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one prompt
        if not isinstance(prompt, str) or not prompt:
            raise _Refused(400, "prompt must be a non-empty text")
        context = episode.recorder.prepare_text(prompt)
        turn = await self._sample(episode, context, body)
        text = self.tokenizer.decode(turn.ids, skip_special_tokens=True)
        reply = {"role": "assistant", "content": text}
        episode.recorder.record(context, turn.ids, turn.logprobs, turn.version, reply, turn.ended)
        finish = "stop" if turn.ended else "length"
        usage = _usage(len(context.prompt_ids), len(turn.ids))
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if body.get("stream"):
            response = await _sse_start(request)
            await _sse(response, _envelope("text_completion", self.model_name, choice, None))
            return await _sse_done(response)
        return web.json_response(_envelope("text_completion", self.model_name, choice, usage))

    def _check_sampling(self, body: dict) -> None:
        temperature = body.get("temperature")
        if None not in (temperature, self.temperature) and float(temperature) != self.temperature:
            raise _Refused(
                400,
                f"temperature={temperature}: this endpoint samples at the run's temperature "
                f"{self.temperature} (the loss's), the distribution the trainer scores",
            )
        if body.get("n", 1) != 1:
            raise _Refused(400, "n must be 1 (an agent's call is one turn of its episode)")
        for key in ("stop", "top_p", "presence_penalty", "frequency_penalty", "logit_bias"):
            if body.get(key) not in (None, [], 1.0 if key == "top_p" else 0):
                raise _Refused(400, f"{key} is not supported: the policy samples plainly")

    async def _sample(self, episode: EpisodeState, context: Any, body: dict) -> Any:
        recorder, prompt = episode.recorder, context.prompt_ids
        if episode.first_prompt is None:
            episode.first_prompt = len(prompt)
        room = episode.first_prompt + episode.budget - len(prompt)
        asked = next(
            (body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
            self.max_new_tokens,
        )
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            recorder.release(context)
            raise _Refused(400, f"max_tokens must be an int >= 1, got {asked!r}")
        if room <= 0:
            recorder.release(context)
            episode.error = (
                f"episode {episode.id} exceeded its token budget (rollout.max_episode_tokens="
                f"{episode.budget} after its first prompt)"
            )
            episode.closed = True
            raise _Refused(400, episode.error, "context_length_exceeded")
        try:
            future = self.sampler.submit(prompt, min(int(asked), room))
            return await asyncio.wrap_future(future)
        except BaseException:
            recorder.release(context)
            raise

    def _text_ids(self, turn: Any, tools: list | None) -> tuple[list[int], bool]:
        """The ids a chat reply's text is decoded from, and whether without special tokens: a
        tool parser that reads them (its tags may be special tokens) gets them, less the turn's
        terminator, as ``vllm serve`` gives them to vLLM's parsers."""
        if self.tool_parser is None or not tools:
            return turn.ids, True
        if getattr(self.tool_parser, "skip_special_tokens", True):
            return turn.ids, True
        return (turn.ids[:-1] if turn.ended else turn.ids), False

    def _parse(self, episode: EpisodeState, text: str, tools: list | None) -> tuple[str, list]:
        if self.tool_parser is None or not tools:
            return text, []
        parsed = as_parsed_call(self.tool_parser.parse(text, tools))
        if parsed.error:
            episode.tool_parse_errors += 1
            return text, []
        calls = [_openai_call(call) for call in parsed.tool_calls or []]
        episode.tool_calls += len(calls)
        return parsed.content or "", calls

    def _logprobs(self, turn: Any) -> dict:
        tokens = self.tokenizer.convert_ids_to_tokens(turn.ids)
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(tokens, turn.logprobs, strict=True)
            ]
        }

    async def _stream_chat(
        self, request, body, reply, finish, usage, ids: list[int], skip: bool
    ) -> web.StreamResponse:
        """The content token by token, decoded from ``ids`` (:func:`stream_pieces`: whole
        characters, joined the content); a reply with tool calls in one chunk."""
        response = await _sse_start(request)
        name = self.model_name
        await _sse(response, _chunk(name, {"role": "assistant", "content": ""}, None))
        if not reply.get("tool_calls"):
            content = reply["content"]
            for piece in stream_pieces(self.tokenizer, ids, content, skip_special_tokens=skip):
                await _sse(response, _chunk(name, {"content": piece}, None))
        if reply.get("tool_calls"):
            calls = [{"index": i, **call} for i, call in enumerate(reply["tool_calls"])]
            await _sse(response, _chunk(name, {"content": reply["content"], "tool_calls": calls}))
        await _sse(response, _chunk(name, {}, finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            await _sse(response, {**_chunk(name, {}, None), "choices": [], "usage": usage})
        return await _sse_done(response)


def _openai_call(call: Any) -> dict:
    """A parser's tool call as OpenAI's ``{"id", "type", "function": {"name", "arguments"}}``
    (``arguments`` a JSON text)."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": call.get("id") or f"call_{secrets.token_hex(8)}",
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except json.JSONDecodeError as err:
        raise _Refused(400, f"the request body is not JSON: {err}") from err
    if not isinstance(body, dict):
        raise _Refused(400, "the request body must be a JSON object")
    return body


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
    return web.json_response(body, status=status)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _envelope(kind: str, model: str, choice: dict, usage: dict | None) -> dict:
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


def _chunk(model: str, delta: dict, finish: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return _envelope("chat.completion.chunk", model, choice, None)


async def _sse_start(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    return response


async def _sse(response: web.StreamResponse, data: dict) -> None:
    await response.write(f"data: {json.dumps(data)}\n\n".encode())


async def _sse_done(response: web.StreamResponse) -> web.StreamResponse:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
