"""The GRPO example on the toy vision task (task.name=digits): the toy vision-language base is
built and warm-started by the example's own path, then 2 RL steps sample image prompts, in one
process and under torchrun on 2 ranks.

The pieces are tested where they live: the task and image datasets in
tests/tasks/test_image_tasks.py, the toy model in tests/run/test_toy_vision.py, image sampling in
tests/run/test_vision_run.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.engine.vision import has_vision_config
from microrl.run import read_metrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("base") / "tiny-digits"


def _args(base: Path, out: Path) -> list[str]:
    return [
        *TINY_MODEL,
        *TINY_RL,
        "task.name=digits",
        f"model.path={base}",
        f"output.dir={out}",
        "output.plot=false",
        "output.tensorboard=false",
        "train.steps=2",
    ]


def _check(out: Path) -> None:
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    assert all("reward" in r and "loss" in r for r in records[1:])


def test_grpo_trains_the_toy_vision_task(base_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert load_example("grpo_lora").main(_args(base_model, out)) == 0
    assert has_vision_config(base_model)  # the vision toy was built for the task
    _check(out)


def test_grpo_trains_the_toy_vision_task_under_torchrun(base_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(EXAMPLES / "grpo_lora.py"), *_args(base_model, out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check(out)
    assert has_vision_config(base_model)
