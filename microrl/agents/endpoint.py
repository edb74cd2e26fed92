"""The OpenAI-compatible HTTP endpoint agents call; it runs in the trainer process.

An aiohttp server on its own event loop, in a thread of the trainer process, serves
``/episodes/<id>/v1/chat/completions``, ``.../v1/completions`` and ``.../v1/models``. The
episode is named by the base URL the runner gives each agent's client, so agent code never knows
about it. Every call is rendered with the chat template, matched against the episode's recorded
rows (:mod:`microrl.agents.trajectories`) and sampled by the run's sampler
(:class:`~microrl.agents.sampler.BatchingSampler`). Streaming answers are Server-Sent Events.

A request is checked whole (:mod:`microrl.agents.schema`, then the run's sampling options and the
episode's token budget) before anything is sampled; a call refused or failed at any point is
released and leaves no trace in the rows. Every error is answered in OpenAI's shape
(:mod:`microrl.agents.wire`).

Security (docs/rollouts.md#agents): only requests bearing the run's key (``Authorization: Bearer``)
are served, 401 otherwise; the server binds to 127.0.0.1 unless told another host. aiohttp is a
dependency because it serves SSE and many concurrent requests on one loop, without vLLM (which
brings FastAPI, and aiohttp too).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from microrl.agents import wire
from microrl.agents.detokenizer import stream_pieces
from microrl.agents.schema import ChatRequest, CompletionRequest, RequestError, validate_request
from microrl.agents.tool_parsers import as_parsed_call
from microrl.agents.trajectories import CallContext, EpisodeRecorder
from microrl.agents.wire import Refused

__all__ = ["AgentEndpoint", "EpisodeState"]

try:  # the chat templates' engine: a template may refuse a conversation (raise_exception)
    from jinja2 import TemplateError
except ImportError:  # no template renders without it
    TemplateError = ValueError

_MAX_REQUEST_BYTES = 64 << 20
_LOG = logging.getLogger(__name__)
# Sampling options the policy cannot honour, and the values that ask nothing of it.
_UNSUPPORTED = {
    "stop": (None, [], ""),
    "top_p": (None, 1.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


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
        app = web.Application(middlewares=[self._guard], client_max_size=_MAX_REQUEST_BYTES)
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
    async def _guard(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """The key first; then every error as OpenAI's (aiohttp's own 404, 405, 413 too)."""
        if not self._authorized(request):
            return wire.error_response(401, "missing or wrong API key", code="invalid_api_key")
        try:
            return await handler(request)
        except Refused as refused:
            return refused.response()
        except web.HTTPException as exc:  # routing (404, 405) and the body's size (413)
            if exc.status < 400:
                raise
            return _http_error(request, exc)
        except ConnectionError:  # the client left mid-stream: nobody to answer
            raise
        except Exception as err:  # a bug or a sampler failure: logged, answered as OpenAI's
            _LOG.exception("the agent endpoint failed on %s %s", request.method, request.path)
            return wire.error_response(500, f"{type(err).__name__}: {err}")

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        # aiohttp decodes header bytes as UTF-8 with surrogate escapes: any bytes compare.
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.api_key.encode())

    def _episode(self, request: web.Request) -> EpisodeState:
        episode = self.episodes.get(request.match_info["episode"])
        if episode is None:
            raise Refused(404, f"no episode {request.match_info['episode']!r}")
        if episode.closed:
            raise Refused(409, f"episode {episode.id} has ended: its calls are refused")
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        self._episode(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "microrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        raw, body = await self._read(request, ChatRequest)
        tools = raw.get("tools") or None
        context = _prepare(lambda: episode.recorder.prepare(raw["messages"], tools))
        try:
            turn = await self._sample(episode, context, body)
            ids, skip = self._text_ids(turn, tools)
            text = self.tokenizer.decode(ids, skip_special_tokens=skip)
            content, calls = self._parse(episode, text, tools)
        except BaseException:
            episode.recorder.release(context)
            raise
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        episode.recorder.record(context, turn, reply)
        finish = "tool_calls" if calls else ("stop" if turn.ended else "length")
        usage = wire.usage(len(context.prompt_ids), len(turn.ids))
        if body.stream:
            return await self._stream_chat(request, body, reply, finish, usage, ids, skip)
        logprobs = self._logprobs(turn) if body.logprobs else None
        choice = {"index": 0, "message": reply, "finish_reason": finish, "logprobs": logprobs}
        return web.json_response(wire.envelope("chat.completion", self.model_name, choice, usage))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        episode = self._episode(request)
        _, body = await self._read(request, CompletionRequest)
        context = _prepare(lambda: episode.recorder.prepare_text(body.prompt))
        try:
            turn = await self._sample(episode, context, body)
        except BaseException:
            episode.recorder.release(context)
            raise
        text = self.tokenizer.decode(turn.ids, skip_special_tokens=True)
        reply = {"role": "assistant", "content": text}
        episode.recorder.record(context, turn, reply)
        finish = "stop" if turn.ended else "length"
        usage = wire.usage(len(context.prompt_ids), len(turn.ids))
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        if body.stream:
            response = await wire.sse_start(request)
            await wire.sse(
                response, wire.envelope("text_completion", self.model_name, choice, None)
            )
            return await wire.sse_done(response)
        return web.json_response(wire.envelope("text_completion", self.model_name, choice, usage))

    async def _read(self, request: web.Request, schema: type) -> tuple[dict, Any]:
        """The request's JSON and its validated fields, checked against what the run samples;
        nothing of the episode has changed yet."""
        raw = await wire.read_json(request)
        try:
            body = validate_request(schema, raw)
        except RequestError as err:
            raise Refused(400, err.message, param=err.param) from None
        self._check_sampling(body)
        return raw, body

    def _check_sampling(self, body: Any) -> None:
        temperature = body.temperature
        if None not in (temperature, self.temperature) and temperature != self.temperature:
            raise Refused(
                400,
                f"temperature={temperature}: this endpoint samples at the run's temperature "
                f"{self.temperature} (the loss's), the distribution the trainer scores",
                param="temperature",
            )
        if body.n not in (None, 1):
            raise Refused(
                400, "n must be 1 (an agent's call is one turn of its episode)", param="n"
            )
        for key, plain in _UNSUPPORTED.items():
            if key in type(body).model_fields and getattr(body, key) not in plain:
                raise Refused(400, f"{key} is not supported: the policy samples plainly", param=key)

    async def _sample(self, episode: EpisodeState, context: CallContext, body: Any) -> Any:
        """The turn sampled for ``context``, at most the call's token limit and the room its
        row has left in the episode's budget (none left: the episode fails)."""
        prompt = context.prompt_ids
        room = episode.recorder.first_prompt + episode.budget - len(prompt)
        asked = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if room <= 0:
            episode.error = (
                f"episode {episode.id} exceeded its token budget (rollout.max_episode_tokens="
                f"{episode.budget} after its first prompt)"
            )
            episode.closed = True
            raise Refused(400, episode.error, param="messages", code="context_length_exceeded")
        future = self.sampler.submit(prompt, min(asked or self.max_new_tokens, room))
        return await asyncio.wrap_future(future)

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
        """The reply's content and tool calls; a parser refusing the ``tools`` (``TypeError``,
        ``ValueError``) refuses the call (400), one returning no result is a bug (500)."""
        if self.tool_parser is None or not tools:
            return text, []
        try:
            result = self.tool_parser.parse(text, tools)
        except (TypeError, ValueError) as err:
            raise Refused(
                400, f"tools: the tool parser refused them: {err}", param="tools"
            ) from err
        parsed = as_parsed_call(result)
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
        response = await wire.sse_start(request)
        name, chunk, sse = self.model_name, wire.chunk, wire.sse
        await sse(response, chunk(name, {"role": "assistant", "content": ""}, None))
        if not reply.get("tool_calls"):
            content = reply["content"]
            for piece in stream_pieces(self.tokenizer, ids, content, skip_special_tokens=skip):
                await sse(response, chunk(name, {"content": piece}, None))
        if reply.get("tool_calls"):
            calls = [{"index": i, **call} for i, call in enumerate(reply["tool_calls"])]
            await sse(response, chunk(name, {"content": reply["content"], "tool_calls": calls}))
        await sse(response, chunk(name, {}, finish))
        if body.stream_options is not None and body.stream_options.include_usage:
            await sse(response, {**chunk(name, {}, None), "choices": [], "usage": usage})
        return await wire.sse_done(response)


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


def _prepare(prepare: Callable[[], CallContext]) -> CallContext:
    """A call's context; a conversation the chat template cannot render is refused (400)."""
    try:
        return prepare()
    except (TypeError, ValueError, TemplateError, RecursionError) as err:
        raise Refused(400, f"messages: {err}", param="messages") from err


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's routing and size errors in OpenAI's shape (405 keeps its ``Allow``)."""
    messages = {
        404: f"no route {request.method} {request.path}: an episode's base URL serves "
        "/chat/completions, /completions (POST) and /models (GET)",
        405: f"{request.method} is not allowed on {request.path}",
        413: f"the request body is larger than {_MAX_REQUEST_BYTES >> 20} MiB",
    }
    message = messages.get(exc.status, exc.text or exc.reason)
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return wire.error_response(exc.status, message, headers=headers)
