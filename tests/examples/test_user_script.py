"""A user's own training script, outside the repository, on its own data and reward.

The script is a copy of the GRPO recipe (``microrl/recipes/grpo.py``, which
``examples/grpo_lora.py`` runs) in a fresh directory, run by the interpreter of
the installed package from that directory (no ``PYTHONPATH``, no ``sys.path`` edits): its prompts
are a JSONL file with its own field names, its reward a ``my_reward.py`` beside it plus a second,
weighted one from a file path, its base model a local checkpoint that was never warm-started.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_RL

from microrl.configs.run import ModelConfig
from microrl.run import read_metrics
from microrl.run.toy_model import build_model, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]

MY_REWARD = '''\
"""The user's reward: 1 when the answer is right (the last number counts)."""
from microrl.tasks.rewards import parse_number


def score(completions, answers):
    return [float(parse_number(c) == float(a)) for c, a in zip(completions, answers)]
'''
SHORT_REWARD = """\
def short(completions, **kwargs):
    return [1.0 if len(c) <= 3 else 0.0 for c in completions]
"""


@pytest.mark.slow
def test_a_user_script_trains_on_its_own_dataset_and_reward(tmp_path: Path) -> None:
    # The user's base model: any local transformers checkpoint (here a tiny, untrained one).
    tokenizer = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tokenizer
    )
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    # Their data, their reward, their copy of the recipe.
    (tmp_path / "data").mkdir()
    rows = [{"question": f"{a}+{b}=", "sum": a + b} for a in range(6) for b in range(6)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_reward.py").write_text(MY_REWARD)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "format.py").write_text(SHORT_REWARD)
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "microrl" / "recipes" / "grpo.py", tmp_path / "scripts" / "train.py")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    args = [
        *TINY_RL,
        "model.path=base",
        "task.name=dataset",
        "task.dataset.train_file=data/train.jsonl",
        "task.dataset.prompt_field=question",
        "task.dataset.answer_field=sum",
        "task.eval_size=4",
        "task.rewards.functions=[my_reward:score,rewards/format.py:short]",
        "task.rewards.weights=[1.0,0.1]",
        "train.steps=2",
        "output.dir=out",
        "output.progress=false",
        "output.tensorboard=false",
        "output.plot=false",
    ]
    result = subprocess.run(
        [sys.executable, "scripts/train.py", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0.0 <= r["reward"] <= 1.1 for r in records[1:])
    assert "eval/accuracy" in records[-1]
    assert (tmp_path / "out" / "adapter").is_dir()
    assert "name: dataset" in (tmp_path / "out" / "config.yaml").read_text()
