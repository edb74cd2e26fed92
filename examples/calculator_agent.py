"""A calculator agent, written against the OpenAI API as any user's agent is.

Trained by microrl through its OpenAI-compatible endpoint (docs/rollouts.md), on the
calculator task (3-digit sums the toy model cannot do alone, docs/tasks.md#calculator). On its
own, against any OpenAI-compatible server that parses tool calls (``vllm serve MODEL
--enable-auto-tool-choice --tool-call-parser hermes``):

    python examples/calculator_agent.py --base-url http://127.0.0.1:8000/v1 --model MODEL

An episode: the model gets the problem and the ``calculator`` tool; every tool call it makes is
executed (safe arithmetic, :func:`microrl.tasks.calculator.execute_tool_call`) and its result
sent back; the model's first answer without a tool call is final. The reward is 1.0 when the
last number of that answer is the sum, else 0.0 (also after ``MAX_TOOL_ROUNDS`` rounds of calls).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import Any

from microrl.tasks.calculator import CALCULATOR_TOOL, CalculatorTask, execute_tool_call
from microrl.tasks.rewards import numeric_match

MAX_TOOL_ROUNDS = 3  # model calls that may ask for the tool before the answer must come
MAX_TOKENS = 96  # per model call: a tool call in the toy format is 65 tokens with its <eos>


async def agent(client: Any, problem: Any, *, model: str = "policy") -> float:
    """One episode on ``problem`` (a :class:`~microrl.tasks.Problem`, or a mapping with
    ``prompt`` and ``answer``) through ``client`` (an ``openai.AsyncOpenAI``); its reward."""
    prompt, answer = _prompt_and_answer(problem)
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(MAX_TOOL_ROUNDS + 1):
        response = await client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR_TOOL], max_tokens=MAX_TOKENS
        )
        message = response.choices[0].message
        calls = [_call_dict(call) for call in message.tool_calls or []]
        if not calls:
            return reward(message.content or "", answer)
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
        for call in calls:
            result = execute_tool_call(call)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return 0.0  # still calling tools: no answer


def reward(final_answer: str, answer: str) -> float:
    """1.0 when the last number of the final answer is the sum (the task's own reward)."""
    return numeric_match([final_answer], [answer])[0]


def _prompt_and_answer(problem: Any) -> tuple[str, str]:
    if isinstance(problem, Mapping):
        return str(problem["prompt"]), str(problem["answer"])
    return str(problem.prompt), str(problem.answer)


def _call_dict(call: Any) -> dict[str, Any]:
    """An OpenAI tool call (the client's object) as the message dict sent back with the history."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


async def _evaluate(base_url: str, api_key: str, model: str, count: int) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    problems = CalculatorTask().eval_problems()[:count]
    rewards = await asyncio.gather(*(agent(client, p, model=model) for p in problems))
    return sum(rewards) / len(rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the server's /v1 URL")
    parser.add_argument("--api-key", default="EMPTY", help="the server's key")
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--problems", type=int, default=50, help="held-out problems to solve")
    args = parser.parse_args()
    solved = asyncio.run(_evaluate(args.base_url, args.api_key, args.model, args.problems))
    print(f"solved {solved:.1%} of {args.problems} held-out problems")


if __name__ == "__main__":
    main()
