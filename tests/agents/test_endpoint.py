"""The endpoint itself (microrl/agents/endpoint.py) under the real ``openai`` client: the key,
refused calls, ``/v1/models``, ``/v1/completions``, tool calls through a parser (one returning
the tuple, tags that are special tokens), options, streamed text of characters split across
tokens."""

from __future__ import annotations

import json
from concurrent.futures import Future

import httpx
import openai
import pytest
from agent_utils import byte_tokenizer, chat_tokenizer

from microrl.agents import AgentEndpoint, Turn
from microrl.agents.tool_parsers import HermesParser, ParsedCall
from microrl.rollout.episodes import ObservationRenderer

CALL = '{"name": "add", "arguments": {"a": 1}}'


class FixedSampler:
    """Answers every call with the ids of ``text`` and its terminator."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text
        self.prompts: list[list[int]] = []

    def submit(self, prompt_ids, max_tokens) -> Future:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.eos_token_id][:max_tokens]
        future: Future = Future()
        future.set_result(Turn(ids, [-0.5] * len(ids), 3, ids[-1] == self.tokenizer.eos_token_id))
        return future


class BraceParser:
    """A stand-in tool parser: a text starting with ``{`` is one call (JSON), else content."""

    def parse(self, text, tools):
        if not text.startswith("{"):
            return ParsedCall(text)
        try:
            call = json.loads(text)
        except json.JSONDecodeError as err:
            return ParsedCall(text, error=str(err))
        return ParsedCall("", [{"name": call["name"], "arguments": call["arguments"]}])


class TupleParser(BraceParser):
    """BraceParser's result as the ``(content, tool_calls, error)`` tuple the docs allow."""

    def parse(self, text, tools):
        parsed = super().parse(text, tools)
        return parsed.content, parsed.tool_calls, parsed.error


def _serve(tokenizer, text: str, parser) -> AgentEndpoint:
    server = AgentEndpoint(
        FixedSampler(tokenizer, text),
        ObservationRenderer(tokenizer),
        temperature=1.0,
        max_new_tokens=64,
        tool_parser=parser,
    ).start()
    server.add_episode("e1", budget=256)
    return server


@pytest.fixture
def endpoint():
    server = _serve(chat_tokenizer(), CALL, BraceParser())
    yield server
    server.close()


def _client(endpoint, key=None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=endpoint.base_url("e1"), api_key=key or endpoint.api_key, max_retries=0
    )


def test_only_the_runs_key_is_served(endpoint):
    assert endpoint.host == "127.0.0.1" and len(endpoint.api_key) >= 32
    with pytest.raises(openai.AuthenticationError, match="missing or wrong API key"):
        _client(endpoint, key="not-the-key").models.list()
    reply = httpx.get(endpoint.base_url("e1") + "/models")  # no key at all
    assert reply.status_code == 401
    assert [m.id for m in _client(endpoint).models.list()] == ["microrl-policy"]


def test_calls_of_an_unknown_or_ended_episode_are_refused(endpoint):
    messages = [{"role": "user", "content": "a"}]
    _client(endpoint).chat.completions.create(model="m", messages=messages)
    endpoint.end_episode("e1")
    with pytest.raises(openai.ConflictError, match="episode e1 has ended"):
        _client(endpoint).chat.completions.create(model="m", messages=messages)
    other = openai.OpenAI(base_url=endpoint.base_url("e9"), api_key=endpoint.api_key)
    with pytest.raises(openai.NotFoundError, match="no episode 'e9'"):
        other.chat.completions.create(model="m", messages=messages)


def test_options_the_policy_cannot_honour_are_refused(endpoint):
    create = _client(endpoint).chat.completions.create
    messages = [{"role": "user", "content": "a"}]
    with pytest.raises(openai.BadRequestError, match=r"the run's temperature 1\.0"):
        create(model="m", messages=messages, temperature=0.2)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        create(model="m", messages=messages, n=2)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens: .* greater than or equal to 1"):
        create(model="m", messages=messages, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="stop is not supported"):
        create(model="m", messages=messages, stop=["x"])
    create(model="m", messages=messages, temperature=1.0, top_p=1.0)  # the run's own: served


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_parsed_and_their_results_extend_the_row(endpoint, stream):
    client = _client(endpoint)
    messages = [{"role": "user", "content": "1+2"}]
    if stream:
        chunks = list(client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=True
        ))  # fmt: skip
        calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        call = calls[0]
        message = {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
    else:
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        call, finish = reply.choices[0].message.tool_calls[0], reply.choices[0].finish_reason
        message = reply.choices[0].message.model_dump(exclude_none=True)
    assert finish == "tool_calls" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1}
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    state = endpoint.episodes["e1"]
    assert state.tool_calls == 2 and state.recorder.branches == 0
    (row,) = state.recorder.rows
    prompts = endpoint.sampler.prompts
    assert prompts[1][: len(row.prompt_ids)] == row.prompt_ids and row.turns == 2


def test_a_malformed_tool_call_is_content_and_counted(endpoint):
    endpoint.sampler.text = '{"name": "add", "argu'
    reply = _client(endpoint).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "1"}], tools=TOOLS
    )
    message = reply.choices[0].message
    assert message.tool_calls is None and message.content == '{"name": "add", "argu'
    assert endpoint.episodes["e1"].tool_parse_errors == 1


def test_a_parser_returning_the_documented_tuple_is_served(endpoint):
    endpoint.tool_parser = TupleParser()
    create = _client(endpoint).chat.completions.create
    messages = [{"role": "user", "content": "1"}]
    reply = create(model="m", messages=messages, tools=TOOLS)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "add" and reply.choices[0].finish_reason == "tool_calls"
    endpoint.sampler.text = '{"name": "add", "argu'
    assert create(model="m", messages=messages, tools=TOOLS).choices[0].message.tool_calls is None
    state = endpoint.episodes["e1"]
    assert state.tool_calls == 1 and state.tool_parse_errors == 1
    endpoint.tool_parser.parse = lambda text, tools: ["not", "a", "result"]
    with pytest.raises(
        openai.InternalServerError, match=r"must return a ParsedCall or a \(content"
    ):
        create(model="m", messages=messages, tools=TOOLS)
    assert not any(row.pending for row in state.recorder.rows)  # the call left no row waiting


def test_tool_call_tags_that_are_special_tokens_are_parsed():
    """``<tool_call>`` as a special token: a decode without special tokens would drop it."""
    tags = (HermesParser.start, HermesParser.end)
    tokenizer = byte_tokenizer(tags)
    text = f'I add.{tags[0]}{{"name": "add", "arguments": {{"a": 1}}}}{tags[1]}'
    assert tokenizer.convert_tokens_to_ids(tags[0]) in tokenizer.all_special_ids
    server = _serve(tokenizer, text, HermesParser())
    try:
        for stream in (False, True):
            reply = _chat(server, tools=TOOLS, stream=stream)
            (call,) = reply["tool_calls"]
            assert call["function"]["name"] == "add" and reply["content"] == "I add."
        assert server.episodes["e1"].tool_calls == 2
        server.sampler.text = "no call, <|im_start|> kept"  # tools but no call: specials kept
        assert _chat(server, tools=TOOLS)["content"] == server.sampler.text
        assert _chat(server, tools=None)["content"] == "no call,  kept"
    finally:
        server.close()


def _chat(server, stream: bool = False, **kwargs) -> dict:
    """The reply message of one call, put together from its chunks when streamed."""
    create = _client(server).chat.completions.create
    messages = [{"role": "user", "content": "a"}]
    if not stream:
        message = create(model="m", messages=messages, **kwargs).choices[0].message
        return message.model_dump(exclude_none=True)
    chunks = [c.choices[0].delta for c in create(model="m", messages=messages, stream=True, **kwargs)
              if c.choices]  # fmt: skip
    calls = [c.model_dump(exclude={"index"}) for d in chunks for c in d.tool_calls or []]
    reply = {"content": "".join(d.content or "" for d in chunks), "deltas": chunks}
    return {**reply, "tool_calls": calls} if calls else reply


@pytest.mark.parametrize("text", ["café!", "日本語で", "👍🏽 ok", "a日👍é\n末"])
def test_streamed_text_is_the_replys_for_characters_split_across_tokens(text):
    """A byte-level tokenizer splits these characters' bytes over tokens; streamed and not,
    the agent gets the same text (else, echoing it back, it would start a branch)."""
    tokenizer = byte_tokenizer()
    server = _serve(tokenizer, text, None)
    try:
        assert _chat(server)["content"] == text
        streamed = _chat(server, stream=True)
        assert streamed["content"] == text
        assert not any("\ufffd" in (d.content or "") for d in streamed["deltas"])
        assert len(streamed["deltas"]) > 3  # token by token, not all at once
        cut = _chat(server, max_tokens=2)["content"]  # inside a character, but for café
        assert _chat(server, stream=True, max_tokens=2)["content"] == cut
    finally:
        server.close()


def test_completions_continue_a_text_on_its_recorded_ids(endpoint):
    endpoint.sampler.text = "12"
    client = _client(endpoint)
    first = client.completions.create(model="m", prompt="1+", max_tokens=5)
    assert first.choices[0].text == "12" and first.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt="1+12\n", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "12"
    (row,) = endpoint.episodes["e1"].recorder.rows
    tokenizer = endpoint.tokenizer
    sampled = [*tokenizer("12", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert endpoint.sampler.prompts[1] == [*endpoint.sampler.prompts[0], *sampled, *newline]
    assert row.ids == [*sampled, *newline, *sampled]


def test_a_conversation_that_changed_its_tools_branches_once(endpoint):
    """Each row keeps its tools: calls on the new tools extend the row they started."""
    client = _client(endpoint)
    other = [{"type": "function", "function": {"name": "add", "description": "sums"}}]
    messages = [{"role": "user", "content": "1"}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    for _ in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, tools=other)
        message = reply.choices[0].message.model_dump(exclude_none=True)
        call_id = message["tool_calls"][0]["id"]
        messages = [*messages, message, {"role": "tool", "tool_call_id": call_id, "content": "2"}]
    recorder = endpoint.episodes["e1"].recorder
    assert recorder.branches == 1 and [row.turns for row in recorder.rows] == [1, 2]
