"""The calculator task (microrl/tasks/calculator.py): its problems and reward, the safe calculator,
and the warm-start conversations, rendered by the toy chat template into training rows whose
tool calls the Hermes parser reads back exactly.
"""

from __future__ import annotations

import json
import random

import pytest

from microrl.agents.tool_parsers import HermesParser
from microrl.rollout import turn_terminators
from microrl.run.base_model import conversation_sft_batch
from microrl.run.toy_model import build_tokenizer
from microrl.tasks import Problem
from microrl.tasks.calculator import (
    CALCULATOR_TOOL,
    CalculatorTask,
    evaluate_expression,
    execute_tool_call,
    tool_call,
)
from microrl.tasks.factory import check_tokenizer_covers


@pytest.fixture(scope="module")
def toy():
    tokenizer = build_tokenizer(CalculatorTask.toy_alphabet, CalculatorTask.toy_tokens)
    tokenizer.chat_template = CalculatorTask.chat_template
    return tokenizer


def test_problems_are_three_digit_sums_with_a_held_out_set():
    task = CalculatorTask(eval_size=50, seed=3)
    held_out = task.eval_problems()
    assert len(held_out) == len({p.prompt for p in held_out}) == 50
    assert CalculatorTask(eval_size=50, seed=3).eval_problems() == held_out  # by its seed
    trained = task.sample(random.Random(0), 3000)
    assert not {p.prompt for p in trained} & {p.prompt for p in held_out}
    for p in trained[:200] + held_out:
        a, b = map(int, p.prompt.removesuffix("=").split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and p.answer == str(a + b)
    for bad in (99, 150):
        with pytest.raises(ValueError, match=r"task\.max_operand"):
            CalculatorTask(max_operand=bad)
    with pytest.raises(ValueError, match=r"task\.eval_size"):
        CalculatorTask(max_operand=200, eval_size=101 * 101)


def test_reward_is_the_right_final_answer():
    task = CalculatorTask(eval_size=5)
    problem = Problem("123+456=", "579")
    responses = ["579", "The sum is 579.", "578", "", "579 or 580"]
    assert task.score(responses, [problem] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 responses for 1 problems"):
        task.score(["1", "2"], [problem])


def test_calculator_evaluates_arithmetic_and_nothing_else():
    cases = {"123+456": 579, " (2+3)*4 ": 20, "7/2": 3.5, "-3+1": -2, "7//2": 3, "7%3": 1}
    for expression, value in cases.items():
        assert evaluate_expression(expression) == value
    bad = [
        "__import__('os').system('true')", "2**8", "1/0", "5%0", "a+b", "", "  ", "1+",
        "9" * 40, "1" * 201, "1e300*1e300", "[1, 2]", "True+1", "'1'+'2'", "f(1)",
    ]  # fmt: skip
    for expression in bad:
        with pytest.raises(ValueError):
            evaluate_expression(expression)
    with pytest.raises(ValueError, match="string"):
        evaluate_expression(12)


def test_tool_executor_answers_errors_instead_of_raising():
    assert execute_tool_call(tool_call("123+456")) == "579"
    assert execute_tool_call(tool_call("10/4")) == "2.5"
    assert execute_tool_call(tool_call("6/3")) == "2"
    as_dict = {"function": {"name": "calculator", "arguments": {"expression": "1+1"}}}
    assert execute_tool_call(as_dict) == "2"
    errors = [
        tool_call("1/0"),
        tool_call("import os"),
        {"function": {"name": "weather", "arguments": "{}"}},
        {"function": {"name": "calculator", "arguments": "{not json"}},
        {"function": {"name": "calculator", "arguments": '{"expr": "1+1"}'}},
        {"function": {"name": "calculator", "arguments": '{"expression": 2}'}},
        {"function": {"name": "calculator", "arguments": "[1]"}},
        {"function": None},
        {},
        None,
    ]
    for call in errors:
        assert execute_tool_call(call).startswith("error: "), call


def test_warm_start_teaches_the_tool_call_format_on_a_share_of_examples(toy):
    task = CalculatorTask(eval_size=20)
    conversations = task.warm_start_conversations(random.Random(1), 400, tool_share=0.1)
    with_tool = [c for c in conversations if len(c) == 4]
    assert 20 <= len(with_tool) <= 60 and len(conversations) == 400
    assert all(len(c) == 2 for c in conversations if c not in with_tool)
    assert all(len(c) == 4 for c in task.warm_start_conversations(random.Random(1), 5, 1.0))
    with pytest.raises(ValueError, match="tool_share"):
        task.warm_start_conversations(random.Random(1), 5, 1.5)
    check_tokenizer_covers(toy, task, "calculator")
    # the template ends every assistant turn, tool calls included, with <eos>
    assert turn_terminators(toy) == (toy.eos_token_id,)

    sample = [conversations[0] if len(conversations[0]) == 2 else conversations[1], with_tool[0]]
    batch = conversation_sft_batch(toy, sample, tools=[CALCULATOR_TOOL])
    direct, tooled = sample
    for row, messages in enumerate(sample):
        ids = batch["input_ids"][row][batch["attention_mask"][row]].tolist()
        assert toy.unk_token_id not in ids
        text = toy.apply_chat_template(messages, tools=[CALCULATOR_TOOL], tokenize=False)
        assert toy.decode(ids) == text
    # the loss is on the assistant turns only, each through its <eos>
    trained = batch["input_ids"][0][batch["loss_mask"][0]].tolist()
    assert toy.decode(trained) == direct[1]["content"] + "<eos>"
    mask = batch["loss_mask"][1].tolist()
    spans, start = [], None
    for i, on in enumerate([*mask, False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            spans.append(toy.decode(batch["input_ids"][1, start:i].tolist()))
            start = None
    call_text, answer_text = spans
    assert answer_text == tooled[3]["content"] + "<eos>"
    assert call_text.startswith("<tool_call>") and call_text.endswith("</tool_call><eos>")
    # the sampled text of the tool-call turn parses back to the very call (vLLM's hermes parser
    # agrees with the built-in one: tests/agents/test_tool_parsers.py)
    expected = tooled[1]["tool_calls"][0]["function"]
    parser = HermesParser()
    parsed = parser.parse(call_text.removesuffix("<eos>"), [CALCULATOR_TOOL])
    assert parsed.error is None and parsed.content is None
    (call,) = parsed.tool_calls
    assert call["function"] == expected  # the arguments string itself: renders back alike
    assert execute_tool_call(call) == tooled[2]["content"] == tooled[3]["content"]
    # the history with the parsed call renders to the same text: an endpoint reuses the ids
    history = [tooled[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    rendered = toy.apply_chat_template(history, tools=[CALCULATOR_TOOL], tokenize=False)
    assert rendered == toy.apply_chat_template(tooled[:2], tools=[CALCULATOR_TOOL], tokenize=False)
    assert json.loads(call["function"]["arguments"]) == {"expression": tooled[0]["content"][:-1]}


def test_conversation_rows_refuse_templates_that_rewrite_earlier_turns(toy):
    rewriting = build_tokenizer(CalculatorTask.toy_alphabet, CalculatorTask.toy_tokens)
    # earlier assistant turns lose their content once a later message follows
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "<|assistant|>{{ eos_token }}{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    conversation = [
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "4+5="},
    ]
    with pytest.raises(ValueError, match="cannot be isolated"):
        conversation_sft_batch(rewriting, [conversation])
    with pytest.raises(ValueError, match="at least one"):
        conversation_sft_batch(toy, [])


def test_first_turn_score_counts_a_right_answer_or_a_call_that_computes_it(toy):
    task = CalculatorTask(max_operand=300, eval_size=8)
    problems = [CalculatorTask.make(123, 156)] * 5
    call = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
    responses = ["279", "280", call.format("123+156"), call.format("123+155"), "<tool_call>{bad"]
    assert task.first_turn_score(responses, problems) == [1.0, 0.0, 1.0, 0.0, 0.0]
    rendered = task.render_prompt(toy, "123+156=")
    assert rendered.startswith("<bos><|tools|>calculator<|user|>123+156=")
    assert rendered.endswith("<|assistant|>")
    with pytest.raises(ValueError, match="2 responses for 1 problems"):
        task.first_turn_score(["1", "2"], problems[:1])
