"""On-policy distillation in the GRPO recipe (``teacher.*``, docs/recipes.md#teachers).

Tiny base and teacher checkpoints of the toy family (the same tokenizer, other weights): pure
distillation and the mix run a few steps and report ``teacher/reverse_kl`` and
``teacher/wait_s``; the mix runs under ``torchrun`` on 2 gloo ranks (an FSDP2-sharded teacher,
scored in step with the trainer) and with ``rollout.max_staleness=1`` (the teacher scores in
the producer's thread). The advantages' numbers: tests/run/test_teacher.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, TINY_RL, run_recorded

from microrl.configs.run import ModelConfig
from microrl.run import read_metrics
from microrl.run.toy_model import build_model, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["output.plot=false", "output.tensorboard=false", "train.eval_every=100"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A base (student) and a teacher: toy models with the same tokenizer, seeds 0 and 1."""
    root = tmp_path_factory.mktemp("distill")
    tokenizer = build_tokenizer()
    for name, seed in (("base", 0), ("teacher", 1)):
        cfg = ModelConfig(
            hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, seed=seed
        )
        build_model(cfg, tokenizer).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "base", root / "teacher"


def _args(models, out: Path, *extra: str) -> list[str]:
    base, teacher = models
    return [
        *TINY_MODEL, *TINY_RL, *QUIET, f"model.path={base}", f"teacher.path={teacher}",
        f"output.dir={out}", *extra,
    ]  # fmt: skip


def _check_distilled(records: list[dict], steps: int) -> None:
    assert [r["step"] for r in records] == list(range(steps + 1))
    for record in records[1:]:
        # Another model's log-probs (both near-uniform untrained toys): a sampled estimate of
        # the KL, of either sign on a few tokens, but not 0.
        assert abs(record["teacher/reverse_kl"]) > 1e-4 and record["teacher/wait_s"] >= 0
        assert record["grad_norm"] > 0  # the per-token advantages train


def test_pure_distillation_runs(models, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "pure"
    args = _args(models, out, "train.steps=2", "teacher.task_reward=false")
    _, records = run_recorded(args, monkeypatch)
    _check_distilled(records, 2)


def test_distillation_mix_with_max_staleness_1_scores_in_the_producer(
    models, tmp_path: Path, monkeypatch
) -> None:
    args = _args(models, tmp_path / "k1", "train.steps=3", "rollout.max_staleness=1")
    _, records = run_recorded(args, monkeypatch)
    _check_distilled(records, 3)
    assert [r["staleness/max"] for r in records[1:]] == [0, 1, 1]


@pytest.mark.distributed
def test_distillation_mix_under_torchrun(models, tmp_path: Path) -> None:
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(ROOT / "examples" / "grpo_lora.py"), *_args(models, out, "train.steps=2")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check_distilled(read_metrics(out / "metrics.jsonl"), 2)
