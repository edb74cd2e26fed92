"""Tool-call parsing (microrl/agents/tool_parsers.py): the built-in ``hermes`` parser and vLLM's
parsers behind the same interface give the same calls on the Hermes/Qwen format; malformed calls
(bad JSON, unknown tools, open tags, Qwen3's malformed XML) come back as content with an error.
"""

from __future__ import annotations

import json

import pytest

from microrl.agents.tool_parsers import (
    HermesParser,
    ParsedCall,
    ToolCallParser,
    VLLMToolParser,
    as_parsed_call,
    make_tool_parser,
)
from microrl.run.toy_model import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluates arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# text -> (content, [(name, arguments dict)]), on well-formed Hermes text
WELL_FORMED = {
    "just text, no call": ("just text, no call", []),
    call("calculator", expression="123+456"): (None, [("calculator", {"expression": "123+456"})]),
    "Let me compute.\n" + call("calculator", expression="1+2") + "\n": (
        "Let me compute.",
        [("calculator", {"expression": "1+2"})],
    ),
    "Two: " + call("calculator", expression="9*9") + "\n" + call("search", q="x", n=[1, 2]): (
        "Two:",
        [("calculator", {"expression": "9*9"}), ("search", {"q": "x", "n": [1, 2]})],
    ),
    '<tool_call>{"name": "search", "arguments": {}}</tool_call>': (None, [("search", {})]),
}

QWEN3_XML = "<tool_call>\n<function=calculator>\n<parameter=expression>\n1+2\n</parameter>\n</function>\n</tool_call>"
MALFORMED = {
    "bad json": '<tool_call>\n{"name": "calculator", "arguments": {"expression": 1+2}}\n</tool_call>',
    "unknown tool": call("weather", city="Paris"),
    "unclosed tag": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}',
    "unclosed json": '<tool_call>\n{"name": "calculator", "arguments": {"expr',
    "stray close": "text </tool_call> more " + call("calculator", expression="2"),
    "arguments not an object": '<tool_call>{"name": "calculator", "arguments": "1+2"}</tool_call>',
    "no name": '<tool_call>{"arguments": {}}</tool_call>',
    "qwen3 xml in hermes tags": QWEN3_XML,
    "qwen3 xml header without >": QWEN3_XML.replace(
        "<function=calculator>", "<function=calculator"
    ),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module", params=["built-in", "vllm"])
def hermes(request, tokenizer) -> ToolCallParser:
    if request.param == "built-in":
        return make_tool_parser("hermes", tokenizer, prefer_vllm=False)
    pytest.importorskip("vllm")
    return make_tool_parser("hermes", tokenizer)


def summary(parsed: ParsedCall) -> tuple:
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ]
    return parsed.content, calls


def test_make_tool_parser_picks_vllm_when_installed_and_names_the_known_ones(tokenizer):
    assert isinstance(make_tool_parser("hermes", tokenizer, prefer_vllm=False), HermesParser)
    with pytest.raises(ValueError, match=r"unknown tool parser 'nope'.*hermes"):
        make_tool_parser("nope", tokenizer)
    with pytest.raises(TypeError, match="must be a str"):
        make_tool_parser(None, tokenizer)
    pytest.importorskip("vllm")
    parser = make_tool_parser("qwen3_xml", tokenizer)
    assert isinstance(parser, VLLMToolParser) and isinstance(parser, ToolCallParser)
    # Its tags may be special tokens: it reads turns with them, as under vllm serve.
    assert parser.skip_special_tokens is False and HermesParser.skip_special_tokens is False
    with pytest.raises(ValueError, match="llama3_json parser cannot read this tokenizer's"):
        make_tool_parser("llama3_json", tokenizer)  # no <|python_tag|>: refused when built


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_hermes_parses_well_formed_calls_in_openai_format(hermes, tools):
    for text, expected in WELL_FORMED.items():
        parsed = hermes.parse(text, tools)
        assert parsed.error is None, (text, parsed.error)
        assert summary(parsed) == expected, text
        for c in parsed.tool_calls:
            assert set(c) == {"id", "type", "function"} and c["type"] == "function"
            assert isinstance(c["id"], str) and c["id"]
            assert set(c["function"]) == {"name", "arguments"}
            # the arguments as vLLM and the OpenAI API write them: a JSON string, json.dumps' style
            assert c["function"]["arguments"] == json.dumps(json.loads(c["function"]["arguments"]))
        assert len({c["id"] for c in parsed.tool_calls}) == len(parsed.tool_calls)


def test_built_in_and_vllm_hermes_agree(tokenizer):
    pytest.importorskip("vllm")
    ours = make_tool_parser("hermes", tokenizer, prefer_vllm=False)
    theirs = make_tool_parser("hermes", tokenizer)
    for text in [*WELL_FORMED, *MALFORMED.values()]:
        a, b = ours.parse(text, TOOLS), theirs.parse(text, TOOLS)
        assert summary(a) == summary(b), text
        assert (a.error is None) == (b.error is None), (text, a.error, b.error)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_calls_are_content_with_an_error(hermes, case):
    text = MALFORMED[case]
    parsed = hermes.parse(text, TOOLS)
    assert parsed.content == text and parsed.tool_calls == []
    assert isinstance(parsed.error, str) and parsed.error


def test_as_parsed_call_takes_a_parsed_call_or_the_tuple():
    parsed = ParsedCall("hi", [{"name": "f", "arguments": {}}])
    assert as_parsed_call(parsed) is parsed
    assert as_parsed_call(("hi", parsed.tool_calls, None)) == parsed
    assert as_parsed_call(("x", None, "bad")) == ParsedCall("x", [], "bad")
    for wrong in (None, ["hi", [], None], ("hi", [], None, 1), ("hi", "call", None)):
        with pytest.raises(TypeError, match=r"must return a ParsedCall or a \(content"):
            as_parsed_call(wrong)


def test_unknown_names_pass_without_tools_and_bad_tools_are_refused():
    parser = HermesParser()
    assert summary(parser.parse(call("weather", city="P"), None)) == (
        None,
        [("weather", {"city": "P"})],
    )
    with pytest.raises(TypeError, match="tools must be"):
        parser.parse("x", [{"name": "calculator"}])
    with pytest.raises(TypeError, match="tools must be a list"):
        parser.parse("x", {"type": "function"})


def test_vllm_qwen3_xml_parser_never_raises_on_malformed_xml(tokenizer):
    """verl #7044: Qwen3's XML calls with a broken header or parameter; vLLM's ``qwen3_xml``
    parses the good ones, and a broken one is an error or a call with what could be read."""
    pytest.importorskip("vllm")
    parser = make_tool_parser("qwen3_xml", tokenizer)
    good = parser.parse("Sure.\n" + QWEN3_XML, TOOLS)
    assert good.error is None and summary(good) == (
        "Sure.",
        [("calculator", {"expression": "1+2"})],
    )
    broken_header = MALFORMED["qwen3 xml header without >"]
    for tools in (TOOLS, None):  # a misread name is refused with or without tools
        parsed = parser.parse(broken_header, tools)
        assert (parsed.content, parsed.tool_calls) == (broken_header, []) and parsed.error
    broken_parameter = QWEN3_XML.replace("<parameter=expression>", "<parameter=expression")
    parsed = parser.parse(broken_parameter, TOOLS)
    assert parsed.error or summary(parsed) == (None, [("calculator", {})])
    unclosed = QWEN3_XML[: QWEN3_XML.index("</function>")]
    parsed = parser.parse(unclosed, TOOLS)
    assert parsed.content == unclosed or parsed.tool_calls
