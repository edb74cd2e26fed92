"""The agent endpoint's boundary (microrl/agents/endpoint.py, schema.py, wire.py): a malformed
request is a 4xx in OpenAI's error shape naming its field, and a refused call changes nothing:
an episode with refused calls between its real ones has the rows of the same episode without
them (the fuzz test), and nothing refused reaches the sampler."""

from __future__ import annotations

import json
from concurrent.futures import Future

import httpx
import openai
import pytest
from agent_utils import chat_tokenizer

from microrl.agents import AgentEndpoint, Turn
from microrl.agents import endpoint as endpoint_module
from microrl.agents.tool_parsers import ParsedCall
from microrl.rollout.episodes import ObservationRenderer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '{"name": "add", "arguments": {"a": 1}}'
ASSISTANT = "<|im_start|>assistant\n"


class PromptSampler:
    """Answers from the prompt alone, so an episode's rows depend only on the prompts fed: a
    tool call after a user message ``add``, else ``ok`` and the prompt's length mod 10."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: list[list[int]] = []

    def submit(self, prompt_ids, max_tokens) -> Future:
        self.prompts.append(list(prompt_ids))
        text = self.tokenizer.decode(prompt_ids)
        add = text.endswith(f"user\nadd<|im_end|>\n{ASSISTANT}")
        reply = CALL if add else f"ok{len(prompt_ids) % 10}"
        ids = [*self.tokenizer(reply, add_special_tokens=False)["input_ids"]]
        ids = [*ids, self.tokenizer.eos_token_id][:max_tokens]
        logprobs = [-0.01 * (len(prompt_ids) + i) for i in range(len(ids))]
        future: Future = Future()
        future.set_result(Turn(ids, logprobs, 2, ids[-1] == self.tokenizer.eos_token_id))
        return future


class ToolParser:
    """A text starting with ``{`` is one call (a fixed id: rows compare across episodes); a
    tool named ``refuse`` is refused as parsers refuse tools they cannot read."""

    def parse(self, text, tools):
        if any(tool["function"]["name"] == "refuse" for tool in tools):
            raise TypeError("this parser cannot read a tool named 'refuse'")
        if not text.startswith("{"):
            return ParsedCall(text)
        try:
            call = json.loads(text)
        except json.JSONDecodeError as err:
            return ParsedCall(text, error=str(err))
        arguments = json.dumps(call["arguments"])
        function = {"name": call["name"], "arguments": arguments}
        return ParsedCall("", [{"id": "call_add", "type": "function", "function": function}])


@pytest.fixture
def endpoint():
    tokenizer = chat_tokenizer()
    server = AgentEndpoint(
        PromptSampler(tokenizer),
        ObservationRenderer(tokenizer),
        temperature=1.0,
        max_new_tokens=64,
        tool_parser=ToolParser(),
    ).start()
    yield server
    server.close()


def _client(endpoint, episode: str) -> openai.OpenAI:
    url = endpoint.base_url(episode)
    return openai.OpenAI(base_url=url, api_key=endpoint.api_key, max_retries=0)


_HTTP = httpx.Client(timeout=30)  # one pool: a client of its own per request costs ~50 ms


def _post(endpoint, episode: str, route: str = "chat/completions", body=None, **kwargs):
    """A raw request (any bytes, headers, method), with the run's key unless told others."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"}
    headers.update(kwargs.pop("headers", {}))
    content = kwargs.pop("content", None)
    if content is None:
        content = json.dumps(body)
    method = kwargs.pop("method", "POST")
    url = f"{endpoint.base_url(episode)}/{route}"
    return _HTTP.request(method, url, content=content, headers=headers, **kwargs)


def _assert_openai_error(reply: httpx.Response, status: int | None, param: str | None) -> dict:
    """A 4xx (``status`` when given) with OpenAI's error body; its ``param`` starts with
    ``param`` (None: the body's fault, no field)."""
    context = f"{reply.status_code} {reply.text[:300]}"
    assert 400 <= reply.status_code < 500, context
    assert status is None or reply.status_code == status, context
    assert reply.headers["Content-Type"].startswith("application/json"), context
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, context
    assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"
    if param is None:
        assert error["param"] is None, context
    else:
        assert (error["param"] or "").startswith(param), context
        assert error["message"].startswith(error["param"]) or param in error["message"], context
    return error


USER = [{"role": "user", "content": "a"}]
BODY = {"model": "m", "messages": USER}
ASSISTANT_CALL = {"role": "assistant", "content": ""}

# The 13 requests of issue 45 that got HTTP 500: (request kwargs, status, param).
ISSUE_CASES = {
    "non-latin key": (
        {"body": BODY, "headers": {"Authorization": b"Bearer \xff\xe9\x80"}},
        401,
        None,
    ),
    "non-utf8 body": ({"content": b'{"messages": "\xff\xfe"}'}, 400, None),
    "unknown charset": (
        {"body": BODY, "headers": {"Content-Type": "application/json; charset=foo-8"}},
        400,
        None,
    ),
    "nested 100k": ({"content": "[" * 100_000 + "]" * 100_000}, 400, None),
    "5000-digit max_tokens": (
        {"content": json.dumps(BODY)[:-1] + ', "max_tokens": ' + "9" * 5000 + "}"},
        400,
        "max_tokens",
    ),
    "unknown role": ({"body": {**BODY, "messages": [{"role": "wizard"}]}}, 400, "messages[0].role"),
    "object role": (
        {"body": {**BODY, "messages": [{"role": {"a": 1}, "content": "a"}]}},
        400,
        "messages[0].role",
    ),
    "tool_calls a string": (
        {"body": {**BODY, "messages": [*USER, {**ASSISTANT_CALL, "tool_calls": "x"}]}},
        400,
        "messages[1].tool_calls",
    ),
    "tool_calls [1]": (
        {"body": {**BODY, "messages": [*USER, {**ASSISTANT_CALL, "tool_calls": [1]}]}},
        400,
        "messages[1].tool_calls[0]",
    ),
    "function a string": (
        {
            "body": {
                **BODY,
                "messages": [*USER, {**ASSISTANT_CALL, "tool_calls": [{"function": "f"}]}],
            }
        },
        400,
        "messages[1].tool_calls[0].function",
    ),
    "temperature a string": ({"body": {**BODY, "temperature": "hot"}}, 400, "temperature"),
    "temperature a list": ({"body": {**BODY, "temperature": [1.0]}}, 400, "temperature"),
    "completions temperature": (
        {"route": "completions", "body": {"prompt": "1+", "temperature": "x"}},
        400,
        "temperature",
    ),
}


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_bad_requests_get_a_4xx_naming_the_field(endpoint, case):
    kwargs, status, param = ISSUE_CASES[case]
    endpoint.add_episode("e1", budget=256)
    _assert_openai_error(_post(endpoint, "e1", **kwargs), status, param)
    assert endpoint.sampler.prompts == [] and endpoint.episodes["e1"].recorder.rows == []


def test_the_openai_client_raises_with_the_message_and_the_field(endpoint):
    endpoint.add_episode("e1", budget=256)
    create = _client(endpoint, "e1").chat.completions.create
    with pytest.raises(
        openai.BadRequestError, match="temperature: Input should be a valid number"
    ) as err:
        create(model="m", messages=USER, temperature="hot")
    assert err.value.param == "temperature" and err.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="the run's temperature") as err:
        create(model="m", messages=USER, temperature=0.5)  # valid, but not the run's
    assert err.value.param == "temperature"


def test_routing_and_size_errors_are_openais(endpoint, monkeypatch):
    monkeypatch.setattr(endpoint_module, "_MAX_REQUEST_BYTES", 1 << 10)
    endpoint.close()  # the size limit is the app's: restart with the small one
    endpoint.start()
    endpoint.add_episode("e1", budget=256)
    error = _assert_openai_error(_post(endpoint, "e1", "nothing", BODY), 404, None)
    assert "no route POST" in error["message"] and "/chat/completions" in error["message"]
    reply = _post(endpoint, "e1", method="GET", content=b"")
    assert _assert_openai_error(reply, 405, None) and "POST" in reply.headers["Allow"]
    big = {**BODY, "messages": [{"role": "user", "content": "a" * 2000}]}
    _assert_openai_error(_post(endpoint, "e1", body=big), 413, None)
    reply = _post(endpoint, "e1", "nothing", BODY, headers={"Authorization": "Bearer no"})
    assert _assert_openai_error(reply, 401, None)["code"] == "invalid_api_key"  # key first
    with pytest.raises(openai.NotFoundError, match="no route POST"):
        _client(endpoint, "e1").post("/nothing", cast_to=dict, body={})


def test_a_streamed_call_with_bad_stream_options_is_refused_before_sampling(endpoint):
    """Was HTTP 200 and a stream cut off without ``[DONE]``, its turn recorded for training."""
    endpoint.add_episode("e1", budget=256)
    body = {**BODY, "stream": True, "stream_options": "x"}
    _assert_openai_error(_post(endpoint, "e1", body=body), 400, "stream_options")
    assert endpoint.sampler.prompts == [] and endpoint.episodes["e1"].recorder.rows == []
    body["stream_options"] = {"include_usage": True}
    lines = _post(endpoint, "e1", body=body).text.split("\n\n")
    assert '"usage"' in lines[-3] and lines[-2] == "data: [DONE]"


def test_a_parser_refusing_the_tools_is_a_400_naming_them_and_records_nothing(endpoint):
    endpoint.add_episode("e1", budget=256)
    tools = [{"type": "function", "function": {"name": "refuse"}}]
    create = _client(endpoint, "e1").chat.completions.create
    with pytest.raises(openai.BadRequestError, match="parser cannot read") as err:
        create(model="m", messages=USER, tools=tools)
    assert err.value.param == "tools"
    recorder = endpoint.episodes["e1"].recorder
    assert recorder.rows == [] and recorder.calls == 0 and recorder.first_prompt is None


def _play(endpoint, episode: str, between=lambda route, base: None) -> None:
    """One episode of real calls: a tool call, its result streamed back, a third call, and
    two completions continuing one text; ``between(route, base)`` runs before each call with
    the valid body that call sends."""
    client = _client(endpoint, episode)
    messages = [{"role": "user", "content": "add"}]
    between("chat/completions", {"model": "m", "messages": messages, "tools": TOOLS})
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.model_dump(exclude_none=True)
    messages = [*messages, call, {"role": "tool", "tool_call_id": "call_add", "content": "3"}]
    between("chat/completions", {"model": "m", "messages": messages, "tools": TOOLS})
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    messages = [
        *messages,
        {"role": "assistant", "content": text},
        {"role": "user", "content": "more"},
    ]
    between("chat/completions", {"model": "m", "messages": messages, "tools": TOOLS})
    client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, logprobs=True, max_tokens=5
    )
    between("completions", {"model": "m", "prompt": "1+"})
    reply = client.completions.create(model="m", prompt="1+", max_tokens=4).choices[0].text
    between("completions", {"model": "m", "prompt": f"1+{reply}\n"})
    client.completions.create(model="m", prompt=f"1+{reply}\n")


def _budget_needed(state) -> int:
    """The smallest ``budget`` that plays the episode unchanged: its rows' longest, less its
    first prompt (the first row's)."""
    rows = state.recorder.rows
    return max(len(row.all_ids) for row in rows) - len(rows[0].prompt_ids)


def _snapshot(state) -> tuple:
    """Everything a call could leave in an episode."""
    recorder = state.recorder
    fields = ("prompt_ids", "ids", "model_token", "logprobs", "versions", "marks", "turns")
    fields += ("messages", "text", "tools", "pending")
    rows = [[getattr(row, name) for name in fields] for row in recorder.rows]
    counts = (recorder.calls, recorder.branches)
    return rows, counts, (state.tool_calls, state.tool_parse_errors, state.error, state.closed)


NUMBER = ["hot", "1.0", [1.0], {"a": 1}, True]
INTEGER = ["3", 1.5, [1], {}, True]
COUNT = [*INTEGER, 0, -1]
BOOL = ["yes", 1, [True], {}]
TEXT = [1, [], {}, True]
# Every field the endpoint reads, and values it must refuse: wrong types, out of range, and
# options the run cannot honour (another temperature, n=2, ...).
CHAT_WRONG = {
    "model": TEXT,
    "messages": ["hi", {}, [], [1], ["hi"]],
    "temperature": [*NUMBER, -1, 0.2],
    "top_p": [*NUMBER, 0, 1.5, 0.5],
    "n": [*COUNT, 2],
    "max_tokens": COUNT,
    "max_completion_tokens": COUNT,
    "stop": [1, [1], {}, True, "x", ["x"]],
    "presence_penalty": [*NUMBER, 0.5],
    "frequency_penalty": [*NUMBER, 0.5],
    "logit_bias": ["x", [1], {"1": "a"}, {"1": 5}],
    "seed": ["1", 1.5, True],
    "stream": BOOL,
    "stream_options": ["x", 1, [], {"include_usage": "yes"}],
    "user": TEXT,
    "tools": [
        "x",
        [1],
        {},
        ["add"],
        [{"type": "function"}],
        [{"type": "function", "function": "add"}],
        [{"type": "web", "function": {"name": "add"}}],
        [{"type": "function", "function": {"name": 3}}],
        [{"type": "function", "function": {"name": "add", "parameters": "x"}}],
    ],
    "tool_choice": [1, [], {"type": "function"}, "sometimes"],
    "parallel_tool_calls": BOOL,
    "logprobs": BOOL,
    "top_logprobs": [*INTEGER, -1, 21],
    "response_format": ["json", 1, []],
}
COMPLETION_WRONG = {
    "prompt": [5, None, [], ["a", "b"], [1, 2], {"a": 1}, ""],
    "temperature": [*NUMBER, 0.2],
    "max_tokens": COUNT,
    "n": [*COUNT, 2],
    "best_of": [*COUNT, 2],
    "echo": [*BOOL, True],
    "suffix": [1, "x"],
    "logprobs": ["1", 1.5, 6, -1, True],
    "stream": BOOL,
    "stream_options": ["x", {"include_usage": 1}],
    "stop": [1, ["x"]],
}
# Messages an agent must not send after its conversation: unknown or odd roles and contents,
# malformed tool calls.
BAD_MESSAGES = [
    {"role": "wizard", "content": "a"},
    {"role": {"a": 1}, "content": "a"},
    {"role": None},
    {"content": "a"},
    {"role": "user", "content": 5},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "user", "content": [{"type": "text", "text": 5}]},
    {"role": "user", "content": "a", "name": 5},
    {"role": "tool", "content": "3", "tool_call_id": 5},
    {**ASSISTANT_CALL, "tool_calls": "x"},
    {**ASSISTANT_CALL, "tool_calls": [1]},
    {**ASSISTANT_CALL, "tool_calls": [{"function": "add"}]},
    {**ASSISTANT_CALL, "tool_calls": [{"function": {"arguments": "{}"}}]},
    {**ASSISTANT_CALL, "tool_calls": [{"function": {"name": "add", "arguments": 5}}]},
    "hi",
    1,
    None,
    [],
]
# Bodies that are no request at all.
MALFORMED = [
    {"content": b"not json"},
    {"content": b""},
    {"content": b"[1]"},
    {"content": b'"x"'},
    {"content": b'{"messages": "\xff\xfe"}'},
    {"content": b'{"model": "m"'},
    {"content": "[" * 100_000 + "]" * 100_000},
    {"content": '{"a": ' * 50_000 + "1" + "}" * 50_000},
    {"content": b"{}", "headers": {"Content-Type": "application/json; charset=foo-8"}},
]


def _bad_requests(route: str, base: dict) -> list[tuple[dict, int | None, str | None]]:
    """Refused variants of a valid call (``base``): (request kwargs, status, param)."""
    out: list[tuple[dict, int | None, str | None]] = []
    wrong = CHAT_WRONG if route == "chat/completions" else COMPLETION_WRONG
    for field, values in wrong.items():
        for k, value in enumerate(values):
            stream = {"stream": True} if k % 2 and field not in ("stream", "stream_options") else {}
            out.append(({"route": route, "body": {**base, **stream, field: value}}, 400, field))
    if route == "chat/completions":
        count = len(base["messages"])
        for message in BAD_MESSAGES:
            body = {**base, "messages": [*base["messages"], message]}
            out.append(({"route": route, "body": body}, 400, f"messages[{count}]"))
        digits = json.dumps(base)[:-1] + ', "max_tokens": ' + "9" * 5000 + "}"
        out.append(({"route": route, "content": digits}, 400, "max_tokens"))
        nan = json.dumps(base)[:-1] + ', "temperature": NaN}'
        out.append(({"route": route, "content": nan}, 400, "temperature"))
        key = {"Authorization": b"Bearer \xff\xe9\x80"}
        out.append(({"route": route, "body": base, "headers": key}, 401, None))
        out.append(({"route": route, "body": base, "method": "GET"}, 405, None))
        out.append(({"route": route + "/x", "body": base}, 404, None))
    out += [({"route": route, **kwargs}, 400, None) for kwargs in MALFORMED]
    return out


def test_fuzz_refused_calls_between_real_ones_change_no_row(endpoint):
    """Every malformed body, every field of a wrong type or value, before each call of an
    episode: each is a 4xx naming its field, none reaches the sampler, and the episode's rows,
    counts and first prompt are those of the same episode without them. Its token budget is
    exactly what the episode needs, so a refused call counted as its first prompt would cut a
    turn short (or fail the episode)."""
    endpoint.add_episode("clean", budget=1024)
    _play(endpoint, "clean")
    clean = endpoint.episodes["clean"]
    fed = list(endpoint.sampler.prompts)
    assert len(clean.recorder.rows) == 2 and clean.recorder.rows[0].turns == 3
    need = _budget_needed(clean)
    endpoint.add_episode("dirty", budget=need)
    refused = 0

    def between(route: str, base: dict) -> None:
        nonlocal refused
        requests = _bad_requests(route, base)
        if refused == 0:  # first of all: a refused call with a shorter prompt than the first
            short = {"model": "m", "messages": USER, "max_tokens": 0}
            requests.insert(0, ({"body": short}, 400, "max_tokens"))
        for kwargs, status, param in requests:
            _assert_openai_error(_post(endpoint, "dirty", **kwargs), status, param)
            refused += 1

    _play(endpoint, "dirty", between)
    assert refused > 500
    assert endpoint.sampler.prompts == fed + fed  # no refused call was sampled
    assert _snapshot(endpoint.episodes["dirty"]) == _snapshot(clean)


def test_calls_refused_with_400_leave_no_trace(endpoint):
    """Refusals that were already 400s (``max_tokens=0``, tools the template cannot render)
    recorded their prompt: the agent's next calls started new rows (``agent/branches``), with
    observation ids never fed to the sampler, and a short refused first call cut the budget."""
    endpoint.add_episode("clean", budget=1024)
    _play(endpoint, "clean")
    clean = endpoint.episodes["clean"]
    need = _budget_needed(clean)
    endpoint.add_episode("dirty", budget=need)

    def between(route: str, base: dict) -> None:
        refusals = [{**base, "max_tokens": 0}]
        if route == "chat/completions":
            refusals = [{"model": "m", "messages": USER, "max_tokens": 0}, *refusals]
            refusals.append({**base, "tools": "x"})
        for body in refusals:
            assert _post(endpoint, "dirty", route, body).status_code == 400

    _play(endpoint, "dirty", between)
    dirty = endpoint.episodes["dirty"]
    assert dirty.recorder.branches == clean.recorder.branches == 1  # the chat row, the text row
    assert _snapshot(dirty) == _snapshot(clean)
