"""A toy task that is solved reliably only by calling a tool: 3-digit sums with a calculator.

``"123+456="`` -> ``"579"``. The toy model of the examples learns 3-digit sums only partly, so
an agent scores well only when the model calls the ``calculator`` tool
(:data:`CALCULATOR_TOOL`, executed by :func:`execute_tool_call`: safe arithmetic, no ``eval``)
and answers with its result. The agent is plain ``openai``-client code
(``examples/calculator_agent.py``); the reward is the right final answer (:meth:`score`).

For the toy model the task brings a chat template with tools (:data:`TOY_CHAT_TEMPLATE`, tool
calls in the Hermes/Qwen format ``<tool_call>{json}</tool_call>``), the characters and whole
tokens its tokenizer needs (``toy_alphabet``, ``toy_tokens``), and warm-start conversations
(:meth:`CalculatorTask.warm_start_conversations`) in which a small share of the problems are
solved through the tool: the warm start teaches the format, RL teaches when to call it
(docs/tasks.md#calculator).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import string
from collections.abc import Mapping, Sequence
from typing import Any

from microrl.tasks.base import Problem, answers_for
from microrl.tasks.rewards import numeric_match

__all__ = [
    "CALCULATOR_TOOL",
    "TOY_CHAT_TEMPLATE",
    "CalculatorTask",
    "evaluate_expression",
    "execute_tool_call",
    "tool_call",
]

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression (+ - * / // % and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123+456"}},
            "required": ["expression"],
        },
    },
}

# A compact template for a character-level tokenizer: role markers and the tool-call tags are
# whole tokens (``toy_tokens``); the tools are named, not described (the toy model reads no
# schemas); an assistant turn, tool calls included, ends with <eos>. A tool call is written as
# ``json.dumps`` writes it, so what the endpoint renders back is what the model sampled.
TOY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}"
    '<tool_call>{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}"
    "{% else %}<|user|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOY_TOKENS = ("<|tools|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>", "</tool_call>")
# What prompts, tool calls and tool results are written with (the toy tokenizer adds what it lacks).
CALCULATOR_ALPHABET = string.digits + string.ascii_lowercase + ' +-*/%().=,:"{}_'

# Bounds of the calculator: a model's call is untrusted input.
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_expression(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, ``+ - * / // %``, unary signs and
    parentheses, read with ``ast`` (never ``eval``). Raises ``ValueError`` saying what is wrong
    (another construct, division by zero, a value past :data:`MAX_MAGNITUDE`)."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if not expression.strip() or len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression must have 1 to {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from err
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise ValueError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_value(node.operand))
    else:
        raise ValueError(f"only numbers, + - * / // % and parentheses, got {ast.unparse(node)!r}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a value is larger than {MAX_MAGNITUDE:.0e}")
    return value


def format_value(value: int | float) -> str:
    """``579``, ``2.5``; a float that is whole prints as an integer."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def execute_tool_call(call: Mapping[str, Any]) -> str:
    """The tool message's content for an OpenAI tool call (``{"function": {"name", "arguments"}}``).

    Never raises on the model's input: an unknown tool, arguments that are not a JSON object
    with a string ``expression``, or a bad expression answer ``"error: ..."``, which goes back
    to the model as the tool's result.
    """
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or function.get("name") != "calculator":
        name = function.get("name") if isinstance(function, Mapping) else None
        return f"error: unknown tool {name!r}"
    arguments = function.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return "error: the arguments are not json"
    expression = arguments.get("expression") if isinstance(arguments, Mapping) else None
    if not isinstance(expression, str):
        return "error: give the expression as a string"
    try:
        return format_value(evaluate_expression(expression))
    except ValueError as err:
        return f"error: {err}"


def tool_call(expression: str, call_id: str = "call_0") -> dict[str, Any]:
    """An OpenAI tool call of the calculator on ``expression`` (arguments as ``json.dumps``)."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }


class CalculatorTask:
    """``a+b=`` with ``a, b`` in ``[min_operand, max_operand]`` (3-digit by default);
    ``eval_size`` pairs held out. ``score`` is 1.0 when the last number of a final answer is
    the sum. ``max_operand`` below 100 is refused: the point is sums the model cannot do alone.
    """

    solved_threshold = 1.0
    toy_alphabet = CALCULATOR_ALPHABET
    toy_tokens = TOY_TOKENS
    chat_template = TOY_CHAT_TEMPLATE
    tools = (CALCULATOR_TOOL,)
    min_operand = 100

    def __init__(self, max_operand: int = 999, eval_size: int = 200, seed: int = 0) -> None:
        if not isinstance(max_operand, int) or max_operand < 2 * self.min_operand:
            raise ValueError(
                f"task.max_operand must be >= {2 * self.min_operand} for the calculator task "
                f"(sums of operands in [{self.min_operand}, max_operand]), got {max_operand!r}"
            )
        count = max_operand - self.min_operand + 1
        if not 0 < eval_size < count**2:
            raise ValueError(f"task.eval_size must be in [1, {count**2 - 1}], got {eval_size}")
        self.max_operand = max_operand
        rng = random.Random(seed)
        held_out: set[tuple[int, int]] = set()
        while len(held_out) < eval_size:
            held_out.add((self._operand(rng), self._operand(rng)))
        self._held_out = held_out
        self._eval = [self.make(a, b) for a, b in sorted(held_out)]
        rng.shuffle(self._eval)

    def _operand(self, rng: random.Random) -> int:
        return rng.randint(self.min_operand, self.max_operand)

    @staticmethod
    def make(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` training problems (never a held-out pair)."""
        problems = []
        while len(problems) < n:
            pair = (self._operand(rng), self._operand(rng))
            if pair not in self._held_out:
                problems.append(self.make(*pair))
        return problems

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """1.0 where the last number of a final answer is the sum (the agent's last message)."""
        return numeric_match(responses, answers_for(responses, problems))

    def render_prompt(self, tokenizer: Any, prompt: str) -> str:
        """``prompt`` as the agent's first call renders it: the user's message with the tools,
        and the assistant's header (the tokenizer's chat template)."""
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tools=list(self.tools),
            tokenize=False,
            add_generation_prompt=True,
        )

    def first_turn_score(
        self, responses: Sequence[str], problems: Sequence[Problem]
    ) -> list[float]:
        """The score of a model's *first* turn (its text, tool-call tags kept): 1.0 for a right
        answer at once, or for a well-formed calculator call whose result is the sum (the agent
        would then read the answer back); else 0.0. What the warm start checks: one greedy turn,
        no agent."""
        answers_for(responses, problems)  # the counts must match
        from microrl.agents.tool_parsers import HermesParser

        parser = HermesParser()
        scores = []
        for text, problem in zip(responses, problems, strict=True):
            parsed = parser.parse(text, list(self.tools))
            if parsed.tool_calls and parsed.error is None:
                result = execute_tool_call(parsed.tool_calls[0])
                scores.append(float(result == problem.answer))
            elif HermesParser.start in text:
                scores.append(0.0)  # a malformed call answers nothing
            else:
                scores.extend(numeric_match([text], [problem.answer]))
        return scores

    def warm_start_conversations(
        self, rng: random.Random, n: int, tool_share: float = 0.1
    ) -> list[list[dict[str, Any]]]:
        """``n`` supervised conversations (OpenAI messages, rendered with :attr:`tools`): a share
        ``tool_share`` call the calculator on the problem, read its result and answer it; the
        others answer at once. Both end with the right sum, so the warm start teaches the answer
        format and the tool-call format; which one pays is left to RL."""
        if not 0.0 <= tool_share <= 1.0:
            raise ValueError(f"tool_share must be in [0, 1], got {tool_share!r}")
        conversations = []
        for problem in self.sample(rng, n):
            user = {"role": "user", "content": problem.prompt}
            answer = {"role": "assistant", "content": problem.answer}
            if rng.random() < tool_share:
                call = tool_call(problem.prompt.rstrip("="))
                conversations.append(
                    [
                        user,
                        {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": problem.answer},
                        answer,
                    ]
                )
            else:
                conversations.append([user, answer])
        return conversations
