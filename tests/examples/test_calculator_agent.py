"""The calculator agent (examples/calculator_agent.py) against a stub ``AsyncOpenAI``: the model's
scripted texts are parsed into tool calls as an endpoint would (the Hermes parser), the agent
executes them, sends the results back and is rewarded for the right final answer.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from example_utils import load_example

from microrl.agents.tool_parsers import HermesParser
from microrl.tasks import Problem
from microrl.tasks.calculator import CALCULATOR_TOOL

CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'


class StubClient:
    """``client.chat.completions.create`` answering the scripted texts in order, parsed with
    the Hermes parser into an OpenAI-shaped message; records every request."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request):
        self.requests.append({**request, "messages": [dict(m) for m in request["messages"]]})
        parsed = HermesParser().parse(self.texts.pop(0), request.get("tools"))
        calls = [
            SimpleNamespace(id=c["id"], type="function", function=SimpleNamespace(**c["function"]))
            for c in parsed.tool_calls
        ]
        message = SimpleNamespace(
            role="assistant", content=parsed.content, tool_calls=calls or None
        )
        return SimpleNamespace(choices=[SimpleNamespace(message=message, finish_reason="stop")])


PROBLEM = Problem("123+456=", "579")


def run(texts: list[str], problem=PROBLEM) -> tuple[float, StubClient]:
    client = StubClient(texts)
    reward = asyncio.run(load_example("calculator_agent").agent(client, problem))
    return reward, client


def test_the_agent_calls_the_tool_and_answers_with_its_result():
    reward, client = run([CALL.format("123+456"), "579"])
    assert reward == 1.0 and len(client.requests) == 2
    assert all(r["tools"] == [CALCULATOR_TOOL] for r in client.requests)
    first, second = client.requests
    assert first["messages"] == [{"role": "user", "content": "123+456="}]
    assistant, tool = second["messages"][1:]
    (call,) = assistant["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "123+456"}'}
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": "579"}


def test_answers_without_the_tool_and_bad_calls_are_rewarded_by_the_answer_alone():
    assert run(["578"])[0] == 0.0
    assert run(["the sum is 579"], {"prompt": "123+456=", "answer": "579"})[0] == 1.0
    # a malformed call is plain content (the endpoint's parser): the episode ends there
    reward, client = run(['<tool_call>{"name": "calculator"</tool_call>'])
    assert reward == 0.0 and len(client.requests) == 1
    # a bad expression gets the tool's error back, and the model may try again
    reward, client = run([CALL.format("123/0"), CALL.format("123+456"), "579"])
    assert reward == 1.0
    assert client.requests[1]["messages"][-1]["content"] == "error: division by zero"


def test_an_agent_that_never_stops_calling_gets_no_reward():
    agent = load_example("calculator_agent")
    texts = [CALL.format("1+1")] * (agent.MAX_TOOL_ROUNDS + 1)
    reward, client = run(texts)
    assert reward == 0.0 and len(client.requests) == agent.MAX_TOOL_ROUNDS + 1


def test_a_tool_call_of_the_toy_model_fits_in_one_call():
    """The toy model's longest call (its tokenizer: one token per character, whole tags), with
    its <eos>, within the agent's ``max_tokens``: a cut call would be a malformed one."""
    from microrl.run.toy_model import build_tokenizer
    from microrl.tasks.calculator import CalculatorTask, tool_call

    toy = build_tokenizer(CalculatorTask.toy_alphabet, CalculatorTask.toy_tokens)
    toy.chat_template = CalculatorTask.chat_template
    history = [{"role": "assistant", "content": None, "tool_calls": [tool_call("999+999")]}]
    turn = toy.apply_chat_template(history, tokenize=False).removeprefix(toy.bos_token)
    tokens = len(toy(turn.removeprefix("<|assistant|>"), add_special_tokens=False)["input_ids"])
    assert 60 < tokens <= load_example("calculator_agent").MAX_TOKENS
