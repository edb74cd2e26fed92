"""The recipes rewarded by a reward model and an LLM judge (docs/tasks.md#reward-models): GRPO
in process, with ``rollout.max_staleness=1`` (scored ahead in the trainer's background thread),
and under ``torchrun`` on 2 ranks (the reward model a ``RewardModelEngine`` checkpoint with
``task.reward_model.base``), and PPO; the judge is a stand-in server in this process, its key in
the environment, and no file the run writes nor its output shows the key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, TINY_RL, load_example
from model_reward_utils import (
    JUDGE_KEY,
    JudgeScript,
    judge_server,
    save_reward_model,
    train_reward_model_engine,
)

from microrl.run import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _reply(content: str) -> str:
    return f"Score: {len(content)}"  # the template is the response alone: its length


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The stand-in judge (replies after 20 ms), a reward model, and the run's common args;
    the torchrun test swaps in a RewardModelEngine checkpoint (``engine_rm``) for the model."""
    root = tmp_path_factory.mktemp("model_rewards")
    rm = save_reward_model(root / "rm", seed=2)
    _, rm_base, rm_ckpt = train_reward_model_engine(root)
    engine_rm = [f"task.reward_model.path={rm_ckpt}", f"task.reward_model.base={rm_base}"]
    script = JudgeScript(reply=_reply, delay_s=0.02)
    with judge_server(script) as url:
        args = [
            *TINY_MODEL,
            *TINY_RL,
            f"model.path={root / 'base'}",
            f"task.reward_model.path={rm}",
            "task.reward_model.norm=group",
            f"task.judge.url={url}",
            "task.judge.model=stand-in",
            "task.judge.template='{response}'",  # quoted: YAML reads {x} as a mapping
            "task.judge.api_key_env=MICRORL_TEST_JUDGE_KEY",
            "task.rewards.weights=[1.0,0.25]",
            "output.plot=false",
            "output.tensorboard=false",
            "train.steps=3",
        ]
        yield args, script, engine_rm


def _check(out: Path, steps: int, script: JudgeScript, captured: str) -> list[dict]:
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps + 1))
    for r in records[1:]:
        assert r["judge/failures"] == 0
        assert r["loss"] != 0  # group-normalised RM scores differ within groups
    # Counted when scored: under max_staleness > 0 a step may count the next step's rows.
    assert sum(r["judge/requests"] for r in records[1:]) > 0
    assert any("reward_model/score_mean" in r for r in records[1:])
    assert set(script.auth) == {f"Bearer {JUDGE_KEY}"}
    # The key is in no file of the run (config, metrics, samples, checkpoint) nor its output.
    for path in out.rglob("*"):
        if path.is_file():
            assert JUDGE_KEY.encode() not in path.read_bytes(), path
    assert JUDGE_KEY not in captured
    return records


@pytest.mark.parametrize(
    ("recipe", "staleness"), [("grpo_lora", 0), ("grpo_lora", 1), ("ppo_lora", 0)]
)
def test_a_recipe_with_a_reward_model_and_a_judge(
    setup, recipe, staleness, tmp_path, monkeypatch, capfd
):
    args, script, _ = setup
    monkeypatch.setenv("MICRORL_TEST_JUDGE_KEY", JUDGE_KEY)
    out = tmp_path / "out"
    run = [*args, f"output.dir={out}", f"rollout.max_staleness={staleness}"]
    before = len(script.requests)
    assert load_example(recipe).main(run) == 0
    # The first run warm-starts the base model on its own reward: its 500-prompt accuracy
    # checks never ask the judge (3 steps of 8 rows and 3 evaluations of 8 prompts do).
    assert len(script.requests) - before <= 3 * 8 + 3 * 8
    records = _check(out, 3, script, "".join(capfd.readouterr()))
    if staleness:
        assert [r["staleness/max"] for r in records[1:]] == [0, 1, 1]
        assert all(r["staleness/take_wait_s"] >= 0 for r in records[1:])


@pytest.mark.distributed
def test_grpo_with_a_reward_model_and_a_judge_under_torchrun(setup, tmp_path) -> None:
    """Two ranks, each scoring its own rows with its own copy of a RewardModelEngine checkpoint
    (loaded by each rank alone: no collective in the task's construction), the counts summed."""
    args, script, engine_rm = setup
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "MICRORL_TEST_JUDGE_KEY": JUDGE_KEY}
    result = subprocess.run(
        [
            *cmd,
            str(ROOT / "examples" / "grpo_lora.py"),
            *args,
            *engine_rm,
            f"output.dir={out}",
            "train.steps=2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check(out, 2, script, result.stdout + result.stderr)
