"""Held-out evaluation of the calculator agent: how often it solves a sum, how often it calls the tool.

A base model (``--model``, e.g. the warm-started toy model at ``outputs/base/tiny-calc``), with
a trained run's LoRA adapter on it (``--adapter outputs/grpo_calculator/adapter``) or not, plays
the agent of ``examples/calculator_agent.py`` on the calculator task's held-out problems
(docs/tasks.md#calculator) through microrl's endpoint, as training does, greedily (or sampled,
``--temperature 1``):

    python examples/calculator_eval.py --model outputs/base/tiny-calc
    python examples/calculator_eval.py --model outputs/base/tiny-calc \\
        --adapter outputs/grpo_calculator/adapter

It prints the solved rate (right final answers) and the tool-call rate (the share of episodes
in which the model called the calculator at least once). ``--max-operand``, ``--eval-size`` and
``--seed`` must be the run's ``task.*`` values for the problems to be the run's held-out ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from microrl.agents.runner import AgentLimits, run_agent_episodes
from microrl.agents.tool_parsers import make_tool_parser
from microrl.rollout import HFRollout
from microrl.rollout.base import SamplingParams
from microrl.run.toy_model import load_pretrained
from microrl.tasks.calculator import CalculatorTask
from microrl.tasks.rewards import resolve_reward_fn

__all__ = ["evaluate", "main"]


class _Spy:
    """An ``AsyncOpenAI`` client that notes whether any reply carried tool calls."""

    def __init__(self, client: Any) -> None:
        self.called_tool = False
        self._create = client.chat.completions.create
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request: Any) -> Any:
        response = await self._create(**request)
        self.called_tool |= bool(response.choices[0].message.tool_calls)
        return response


def evaluate(
    model: str,
    adapter: str | None = None,
    *,
    max_operand: int = 999,
    eval_size: int = 200,
    seed: int = 0,
    problems: int | None = None,
    max_episode_tokens: int = 100,
    temperature: float = 0.0,
) -> dict[str, float]:
    """``{"solved", "tool_calls", "episodes"}`` of agent episodes on the held-out problems (the
    first ``problems`` of them; None: all), greedy, or sampled at ``temperature`` > 0 (seeded)."""
    tokenizer, policy = load_pretrained(model)
    if adapter:
        from peft import PeftModel

        policy = PeftModel.from_pretrained(policy, adapter).merge_and_unload().eval()
    task = CalculatorTask(max_operand, eval_size, seed)
    held_out = task.eval_problems()[:problems]
    # examples/calculator_agent.py, beside this file, loaded as task.agent loads it.
    agent = resolve_reward_fn(
        f"{Path(__file__).resolve().parent / 'calculator_agent.py'}:agent", "task.agent.function"
    )
    episodes: list[tuple[float, bool]] = []  # (reward, called the tool) per episode

    async def counted(client: Any, problem: Any) -> float:
        spy = _Spy(client)
        reward = await agent(spy, problem)
        episodes.append((reward, spy.called_tool))
        return reward

    run_agent_episodes(
        HFRollout(policy, tokenizer),
        held_out,
        counted,
        SamplingParams(
            greedy=temperature <= 0, temperature=temperature or 1.0, max_new_tokens=96, seed=seed
        ),
        AgentLimits(max_tokens=max_episode_tokens),
        tool_parser=make_tool_parser("hermes", tokenizer),
    )
    count = max(len(episodes), 1)
    return {
        "solved": sum(r >= task.solved_threshold for r, _ in episodes) / count,
        "tool_calls": sum(called for _, called in episodes) / count,
        "episodes": float(len(episodes)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the base model's checkpoint directory")
    parser.add_argument("--adapter", help="a trained run's LoRA adapter (output.dir/adapter)")
    parser.add_argument("--max-operand", type=int, default=999, help="the run's task.max_operand")
    parser.add_argument("--eval-size", type=int, default=200, help="the run's task.eval_size")
    parser.add_argument("--seed", type=int, default=0, help="the run's task.seed")
    parser.add_argument("--problems", type=int, help="evaluate only the first N held-out problems")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled"
    )
    args = parser.parse_args(argv)
    result = evaluate(
        args.model,
        args.adapter,
        max_operand=args.max_operand,
        eval_size=args.eval_size,
        seed=args.seed,
        problems=args.problems,
        temperature=args.temperature,
    )
    print(
        f"solved {result['solved']:.1%}, called the tool in {result['tool_calls']:.1%} of "
        f"{int(result['episodes'])} held-out episodes"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
