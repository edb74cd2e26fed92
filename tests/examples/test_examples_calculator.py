"""The GRPO recipe on the built-in calculator task (``task.name=calculator``, tiny sizes): the toy
base model is built with the task's chat template and tool-call tokens and warm-started on its
conversations, the calculator agent (examples/calculator_agent.py) plays the episodes through the
endpoint with the Hermes parser, and examples/calculator_eval.py evaluates the base and the
trained adapter on held-out problems."""

from __future__ import annotations

import json
from pathlib import Path

from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.run import read_metrics
from microrl.run.toy_model import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = [
    "task.name=calculator",
    f"task.agent.function={ROOT / 'examples' / 'calculator_agent.py'}:agent",
    "task.max_operand=200",
    "model.max_positions=128",
    "model.warm_start.tool_share=0.5",
    "rollout.max_new_tokens=80",
    "rollout.max_episode_tokens=100",
    "output.plot=false",
    "output.tensorboard=false",
]


def test_grpo_trains_on_the_calculator_task_and_its_eval_runs(tmp_path, capsys):
    base, out = tmp_path / "tiny-calc", tmp_path / "run"
    args = [*TINY_MODEL, *TINY_RL, *CALCULATOR, f"model.path={base}", f"output.dir={out}"]
    assert load_example("grpo_lora").main([*args, "train.steps=2"]) == 0
    tokenizer = load_tokenizer(base)  # the task's template and whole tokens, saved with the model
    assert "<tool_call>" in tokenizer.chat_template
    assert len(tokenizer.tokenize("<tool_call>")) == 1
    records = read_metrics(out / "metrics.jsonl")
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    for r in records[1:]:  # every reply was parsed: a call, a malformed one, or plain content
        assert r["agent/tool_calls"] >= 0 and r["agent/tool_parse_errors"] >= 0
        assert r["agent/errors"] == 0 and r["agent/calls_per_episode"] >= 1

    evaluate = load_example("calculator_eval").main
    common = ["--model", str(base), "--max-operand", "200", "--eval-size", "8", "--problems", "3"]
    assert evaluate([*common, "--adapter", str(out / "adapter")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["episodes"] == 3
    assert 0 <= result["solved"] <= 1 and 0 <= result["tool_calls"] <= 1
