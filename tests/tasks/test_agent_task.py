"""``task.agent`` (microrl/tasks/agents.py): the config keys checked by name, the task built
around the prompts, a transcript scored by the wrapped task's reward."""

from __future__ import annotations

import dataclasses
import json

import pytest

from microrl.configs.run import TaskConfig
from microrl.configs.task import AgentConfig, DatasetConfig, RewardsConfig
from microrl.tasks import AgentTask, Problem, is_agent_task, make_task


def test_agent_settings_are_checked_by_name(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"task\.agent\.function must be null for task\.name=hinted_addition or env",
    ):
        TaskConfig(name="hinted_addition", agent=AgentConfig(function="my:agent"))
    with pytest.raises(ValueError, match=r"task\.agent\.timeout_s"):
        TaskConfig(agent=AgentConfig(function="my:agent", timeout_s=0))
    with pytest.raises(ValueError, match=r"task\.agent\.max_concurrency"):
        TaskConfig(agent=AgentConfig(function="my:agent", max_concurrency=-1))
    from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig

    with pytest.raises(ValueError, match=r"task\.agent\.function must be null for PPO"):
        PPOExampleConfig(task=TaskConfig(agent=AgentConfig(function="my:agent")))
    with pytest.raises(
        ValueError, match=r"task\.agent\.function must be null with actor\.sequence_para"
    ):
        actor = dataclasses.replace(GRPOExampleConfig().actor, sequence_parallel_size=2)
        GRPOExampleConfig(task=TaskConfig(agent=AgentConfig(function="my:agent")), actor=actor)
    with pytest.raises(
        ValueError,
        match=r"task\.rewards\.overlong_buffer must be 0 with task\.name=hinted_addition or env or a task\.agent\.function",
    ):
        GRPOExampleConfig(
            task=TaskConfig(
                agent=AgentConfig(function="my:agent"), rewards=RewardsConfig(overlong_buffer=2)
            )
        )
    with pytest.raises(ValueError, match=r"task\.agent\.function='nowhere\.py:solve'"):
        make_task(
            TaskConfig(max_operand=9, eval_size=8, agent=AgentConfig(function="nowhere.py:solve"))
        )


def test_an_agent_task_plays_the_prompts_and_scores_transcripts(tmp_path):
    (tmp_path / "my_agent.py").write_text("def solve(client, problem):\n    return 1.0\n")
    cfg = TaskConfig(
        max_operand=9, eval_size=8, agent=AgentConfig(function=f"{tmp_path / 'my_agent.py'}:solve")
    )
    task = make_task(cfg)
    assert is_agent_task(task) and isinstance(task, AgentTask) and task.host == "127.0.0.1"
    assert task.eval_problems() == task.prompts.eval_problems()
    assert task.reward("7", Problem("3+4=", "7")) == 1.0
    assert task.reward("8", Problem("3+4=", "7")) == 0.0
    with pytest.raises(TypeError, match="returns a float reward or a transcript"):
        task.reward([1], Problem("3+4=", "7"))


def test_a_dataset_whose_agent_returns_the_reward_needs_no_task_rewards(tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "my_agent.py").write_text("def solve(client, problem):\n    return 1.0\n")
    with pytest.raises(
        ValueError,
        match=r"task\.rewards\.functions must be a non-empty list .* task\.agent\.function",
    ):
        TaskConfig(
            name="dataset", dataset=DatasetConfig(train_file=str(data))
        )  # without an agent: still needed
    agent = f"{tmp_path / 'my_agent.py'}:solve"
    task = make_task(
        TaskConfig(
            name="dataset",
            eval_size=2,
            dataset=DatasetConfig(train_file=str(data)),
            agent=AgentConfig(function=agent),
        )
    )
    assert is_agent_task(task) and len(task.eval_problems()) == 2
    with pytest.raises(
        TypeError, match=r"returned a transcript \(str\), but task\.rewards\.functions is"
    ):
        task.reward("2", Problem("1+1=", "2"))  # nothing scores a transcript


CALC_AGENT = "examples/calculator_agent.py:agent"


def test_the_calculator_task_and_its_keys_are_checked_by_name():
    from microrl.configs.run import WarmStartConfig

    with pytest.raises(
        ValueError, match=r"task\.agent\.function must be an agent .* task\.name=calculator"
    ):
        TaskConfig(name="calculator", max_operand=999)
    with pytest.raises(ValueError, match=r"task\.max_operand must be >= 200 for task\.name=calc"):
        TaskConfig(name="calculator", max_operand=150, agent=AgentConfig(function=CALC_AGENT))
    with pytest.raises(
        ValueError, match=r"task\.agent\.tool_parser must be null unless task\.agent\.function"
    ):
        TaskConfig(agent=AgentConfig(tool_parser="hermes"))
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"model\.warm_start\.tool_share must be in \[0, 1\]"):
            WarmStartConfig(tool_share=bad)
    cfg = TaskConfig(
        name="calculator", max_operand=300, eval_size=8, agent=AgentConfig(function=CALC_AGENT)
    )
    with pytest.raises(
        ValueError, match=r"task\.agent\.tool_parser='nope': .*known here: .*hermes"
    ):
        make_task(
            dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, tool_parser="nope"))
        )


def test_the_calculator_task_is_played_by_its_agent_with_the_hermes_parser_by_default():
    from microrl.tasks.calculator import CalculatorTask

    cfg = TaskConfig(
        name="calculator", max_operand=300, eval_size=8, agent=AgentConfig(function=CALC_AGENT)
    )
    task = make_task(cfg)
    assert is_agent_task(task) and isinstance(task.prompts, CalculatorTask)
    assert task.tool_parser.name == "hermes" and task.prompts.max_operand == 300
    assert task.reward("the sum is 579", Problem("123+456=", "579")) == 1.0
    # Another task with an agent parses no tool calls unless asked to.
    plain = TaskConfig(max_operand=9, eval_size=8, agent=AgentConfig(function=CALC_AGENT))
    assert make_task(plain).tool_parser is None
    parsed = make_task(
        dataclasses.replace(plain, agent=dataclasses.replace(plain.agent, tool_parser="hermes"))
    ).tool_parser
    assert parsed.name == "hermes"
