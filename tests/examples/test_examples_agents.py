"""The GRPO recipe on an agent task (``task.agent``, tiny sizes): in process with rollouts
sampled a step ahead (``rollout.max_staleness=1``), and under ``torchrun`` on 2 ranks.

The endpoint and the rows' exactness are tested in tests/agents/; here the recipe's use of them:
training, evaluation and the ``agent/*`` metrics through the user's ``openai`` agent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.run import read_metrics

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["output.plot=false", "output.tensorboard=false", "rollout.max_new_tokens=3"]

# Two calls, the second after an observation; rewarded by the length of the answers, so that
# the groups' rewards differ and the policy moves.
AGENT_MODULE = """
async def guess_twice(client, problem):
    messages = [{"role": "user", "content": problem.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "+"}]
    second = await client.chat.completions.create(model="policy", messages=messages, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in second if c.choices])
    return len(first.choices[0].message.content + text) / 6
"""


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("base") / "tiny-adder"


def _agent_args(root: Path, base_model: Path, out: Path) -> list[str]:
    (root / "my_agent.py").write_text(AGENT_MODULE)
    return [
        *TINY_MODEL, *TINY_RL, *QUIET, f"model.path={base_model}", f"output.dir={out}",
        f"task.agent.function={root / 'my_agent.py'}:guess_twice",
    ]  # fmt: skip


def _check_agent_metrics(records: list[dict]) -> None:
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    for r in records[1:]:
        assert r["agent/calls_per_episode"] == 2 and r["agent/branches"] == 0
        assert r["agent/errors"] == 0 and r["agent/time_s"] > 0
        if r.get("staleness/max", 0) == 0:  # sampled by the weights trained: the same log-probs
            assert r["mismatch/abs_diff_max"] < 1e-4
    assert any(r["grad_norm"] > 0 for r in records[1:])


def test_grpo_trains_on_an_agent_task_sampled_a_step_ahead(base_model, tmp_path):
    out = tmp_path / "ahead"
    args = [*_agent_args(tmp_path, base_model, out), "train.steps=2", "rollout.max_staleness=1"]
    assert load_example("grpo_lora").main(args) == 0
    records = read_metrics(out / "metrics.jsonl")
    _check_agent_metrics(records)
    assert max(r["staleness/max"] for r in records[1:]) == 1


@pytest.mark.distributed
def test_grpo_trains_on_an_agent_task_under_torchrun(base_model, tmp_path):
    out = tmp_path / "dp"
    args = [*_agent_args(tmp_path, base_model, out), "train.steps=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(ROOT / "examples" / "grpo_lora.py"), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check_agent_metrics(read_metrics(out / "metrics.jsonl"))
