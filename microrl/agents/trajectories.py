"""Token-exact trajectories of an agent's calls: reuse what was sampled, branch on rewrites.

An agent resends its whole conversation on every call. Re-encoding it would give other ids than
the ones sampled (docs/rollouts.md#agents), so each call is matched against the episode's rows:
when the messages extend a row's conversation after one of its model turns with observations
only (user, tool or system messages), the prompt is that row's recorded ids plus the
observations' chat-template delta (:class:`~microrl.rollout.episodes.ObservationRenderer`).
Any other conversation (the agent dropped, edited or summarised turns, or changed its tools)
starts a new row, rendered once: a *branch*. Every row holds exactly the ids fed to the sampler
and the ids it sampled, with their log-probs and policy versions. A call changes the rows only
when its turn is recorded: one refused or failed after :meth:`EpisodeRecorder.prepare` is
released and leaves no trace (no observation ids, no row, no count).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from microrl.agents.sampler import Turn
from microrl.rollout.episodes import ObservationRenderer, Trajectory

__all__ = ["AgentTrajectory", "CallContext", "EpisodeRecorder", "normalize_messages"]

_OBSERVATION_ROLES = ("user", "tool", "system", "developer")


@dataclass
class AgentTrajectory(Trajectory):
    """A :class:`Trajectory` row that also keeps the conversation it covers and, after each
    model turn, a mark ``(messages, tokens, ended)``: how many messages and ids (prompt
    included) the row held then, and whether that turn ended with its terminator."""

    messages: list[dict] = field(default_factory=list)
    marks: list[tuple[int, int, bool]] = field(default_factory=list)
    versions: list = field(default_factory=list)  # per sampled token: its policy version
    pending: bool = False  # a call is sampling on this row's end now
    tools: list[dict] | None = None  # the calls' tools: a call with others starts a new row
    text: str | None = None  # completions: the prompt text and the replies so far

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids


@dataclass
class CallContext:
    """One call's prompt ids and the row its sampled turn goes to: a recorded row it extends
    (by ``delta``, the observations' ids, then the turn) or a ``new`` one, added when its turn
    is recorded."""

    row: AgentTrajectory
    prompt_ids: list[int]
    messages: list[dict]
    text: str | None = None  # completions: the call's prompt text
    delta: list[int] = field(default_factory=list)
    new: bool = False
    first: bool = False  # the episode's first prompt is this call's (until released)


class EpisodeRecorder:
    """The rows of one episode. :meth:`prepare` gives a call's prompt ids; :meth:`record` adds
    the turn sampled for it. Not thread-safe: an episode's calls are handled on one event loop."""

    def __init__(self, renderer: ObservationRenderer) -> None:
        self.renderer = renderer
        self.rows: list[AgentTrajectory] = []
        self.calls = 0
        #: The length of the episode's first prompt, which its token budget counts from.
        self.first_prompt: int | None = None

    @property
    def branches(self) -> int:
        """Rows after the first: conversations that did not extend a recorded one."""
        return max(0, len(self.rows) - 1)

    def prepare(self, messages: Sequence[Mapping[str, Any]], tools: list | None) -> CallContext:
        """The prompt ids of a call with ``messages`` (and ``tools``), reusing recorded ids.
        The call then holds the end of the row it extends until :meth:`record` or
        :meth:`release`; nothing else changes before it is recorded."""
        normalized = normalize_messages(messages)
        if not normalized:
            raise ValueError("messages must be a non-empty list of chat messages")
        match = self._match(normalized, tools)
        if match is None:
            new = AgentTrajectory(prompt_ids=self._render(normalized, tools), tools=tools)
            return self._reserve(CallContext(new, list(new.prompt_ids), normalized, new=True))
        row, (count, tokens, ended) = match
        delta = self.renderer.observation(normalized[count:], with_eos=not ended)
        prefix = row.all_ids[:tokens]
        if tokens == len(row.all_ids) and not row.pending:  # extends the row in place
            return self._reserve(CallContext(row, prefix + delta, normalized, delta=delta))
        new = AgentTrajectory(prompt_ids=prefix + delta, tools=tools)
        return self._reserve(CallContext(new, list(new.prompt_ids), normalized, new=True))

    def _reserve(self, context: CallContext) -> CallContext:
        context.row.pending = True
        if self.first_prompt is None:
            self.first_prompt, context.first = len(context.prompt_ids), True
        return context

    def record(self, context: CallContext, turn: Turn, reply: Mapping[str, Any]) -> None:
        """Add the ``turn`` sampled for ``context`` (its ids, log-probs, version and routing)
        and the assistant message returned for it (``reply``), which a later call's history
        must repeat. A call's prompt is its whole row so far, so the routing of the row's
        latest turn covers every token of it (``routes``, :class:`Trajectory`)."""
        row, ids, ended = context.row, turn.ids, turn.ended
        if context.new:
            self.rows.append(row)
        row.add(context.delta, None)
        row.add(list(ids), list(turn.logprobs))
        row.versions.extend([turn.version] * len(ids))
        if turn.routes is not None:
            row.routes = _row_routes(turn.routes, len(row.all_ids))
        row.turns += 1
        row.pending = False
        self.calls += 1
        if self.first_prompt is None:  # the call that held it was released meanwhile
            self.first_prompt = len(context.prompt_ids)
        row.messages = [*context.messages, *normalize_messages([reply])]
        row.marks.append((len(row.messages), len(row.all_ids), ended))
        if context.text is not None:
            row.text = context.text + str(reply.get("content") or "")

    def prepare_text(self, text: str) -> CallContext:
        """The prompt ids of a completions call: a row's recorded ids when ``text`` continues
        that row's prompt and replies (only the new text is tokenized), else a new row;
        reserved as :meth:`prepare`'s."""
        tokenizer = self.renderer.tokenizer
        for row in self.rows:
            if row.text is not None and not row.pending and text.startswith(row.text):
                delta = list(
                    tokenizer(text[len(row.text) :], add_special_tokens=False)["input_ids"]
                )
                context = CallContext(row, row.all_ids + delta, [], text, delta=delta)
                return self._reserve(context)
        new = AgentTrajectory(prompt_ids=list(tokenizer(text)["input_ids"]))
        return self._reserve(CallContext(new, list(new.prompt_ids), [], text, new=True))

    def release(self, context: CallContext) -> None:
        """A call refused or failed after :meth:`prepare`: the episode is as if it never came
        (its row's end is free again, and the first prompt is not its)."""
        context.row.pending = False
        if context.first:
            self.first_prompt = None

    def trained_rows(self) -> list[AgentTrajectory]:
        """The rows holding at least one sampled token."""
        return [row for row in self.rows if any(row.model_token)]

    def _match(self, messages: list[dict], tools: list | None) -> tuple | None:
        """The row (of the same ``tools``) and mark covering the longest prefix of ``messages``
        followed by observations only, or None."""
        best = None
        for row in self.rows:
            if row.tools != tools:
                continue
            for mark in row.marks:
                count = mark[0]
                rest = messages[count:]
                if (
                    rest
                    and messages[:count] == row.messages[:count]
                    and all(m["role"] in _OBSERVATION_ROLES for m in rest)
                    and (best is None or count > best[1][0])
                ):
                    best = (row, mark)
        return best

    def _render(self, messages: list[dict], tools: list | None) -> list[int]:
        tokenizer = self.renderer.tokenizer
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=self.renderer.template,
            tokenize=False,
            add_generation_prompt=True,
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _row_routes(routes: torch.Tensor, length: int) -> torch.Tensor:
    """A turn's routing ``[n, L, k]`` as its row's: it covers exactly the row's ``length`` ids
    (the call's prompt was the row so far, then the turn)."""
    if len(routes) != length:
        raise ValueError(
            f"a turn's recorded routing covers {len(routes)} tokens, its row holds {length}"
        )
    return routes


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Chat messages as plain dicts a template renders and calls compare: text parts joined,
    ``None`` content as ``""``, tool-call arguments as dicts, client-only fields dropped."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of chat messages, got {type(messages).__name__}")
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise TypeError(f"a chat message must be a mapping with a 'role', got {message!r}")
        item = {"role": str(message["role"]), "content": _text(message.get("content"))}
        calls = message.get("tool_calls")
        if calls:
            item["tool_calls"] = [_tool_call(call) for call in calls]
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                item[key] = message[key]
        out.append(item)
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(f"only text message parts are supported, got {part!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise TypeError(f"a message's content must be a text or text parts, got {content!r}")


def _tool_call(call: Mapping[str, Any]) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # else kept as the text written
            arguments = json.loads(arguments)
    result = {
        "type": "function",
        "function": {"name": function.get("name"), "arguments": arguments},
    }
    if call.get("id") is not None:
        result["id"] = call["id"]
    return result
