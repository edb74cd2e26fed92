"""The example trainings end to end (tiny sizes): GRPO and PPO runs, Ctrl-C and resume, two ranks.

Their pieces are tested where they live: the addition task in ``tests/tasks/test_addition.py``,
the toy tokenizer in ``tests/run/test_toy_model.py``, the transformers rollout in
``tests/rollout/samplers/test_rollout_hf.py``, ``--help`` in ``tests/run/test_example_runs.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from example_utils import LENGTH_REWARD, TINY_MODEL, TINY_RL, load_example, load_recipe

from microrl.run import read_metrics
from microrl.run.toy_model import is_checkpoint, load_pretrained

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny warm-started base model, built once by the GRPO example's own warm-start path."""
    return tmp_path_factory.mktemp("base") / "tiny-adder"


def _run_in_process(module: str, args: list[str]) -> int:
    return load_example(module).main(args)


def _check_outputs(out: Path, last_step: int) -> list[dict]:

    records = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == list(range(last_step + 1)), steps
    for key in (
        "reward",
        "loss",
        "entropy",
        "clipfrac",
        "grad_norm",
        "tokens_per_s",
        "step_time",
    ):
        assert all(key in r for r in records[1:]), key
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    assert "kl" in records[-1]  # train.kl_metric_every: due at the last step too
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((out / "tensorboard").iterdir())
    return records


def _load_adapter(base: Path, adapter: Path) -> None:
    from peft import PeftModel

    _, model = load_pretrained(base)
    peft_model = PeftModel.from_pretrained(model, adapter)
    assert any("lora_A" in n for n, _ in peft_model.named_parameters())


def test_grpo_runs_writes_outputs_and_resumes(base_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "grpo"
    common = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}"]
    assert _run_in_process("grpo_lora", [*common, "train.steps=2"]) == 0
    assert is_checkpoint(base_model)  # the warm start saved model + tokenizer
    _check_outputs(out, last_step=2)
    _load_adapter(base_model, out / "adapter")
    assert "held-out greedy accuracy" in capsys.readouterr().out
    # --resume continues after the saved step, up to the new train.steps.
    assert _run_in_process("grpo_lora", [*common, "train.steps=3", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    records = _check_outputs(out, last_step=3)
    assert records[-1]["step"] == 3


def test_ppo_runs_and_writes_outputs(base_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    args = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}", "train.steps=2"]
    assert _run_in_process("ppo_lora", args) == 0
    records = _check_outputs(out, last_step=2)
    assert all("critic/vf_loss" in r for r in records[1:])
    _load_adapter(base_model, out / "adapter")
    assert (out / "checkpoint" / "critic").is_dir()


def test_grpo_runs_the_reference_and_old_passes_only_when_needed(
    base_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """With ``kl_coef = 0`` the reference pass (adapter off) runs only on the steps that report
    the KL (``train.kl_metric_every`` and the last step), and ``policy_loss.bypass_mode`` drops
    the old log-prob pass: with neither, an RL step runs no inference pass at all."""
    from microrl.engine import ActorEngine

    calls = {"infer": 0, "ref": 0}
    infer, disable = ActorEngine.infer_batch, ActorEngine.disable_adapter

    def counting_infer(self, batch):
        calls["infer"] += self.peft_model is not None  # not the warm start's full fine-tune
        return infer(self, batch)

    def counting_disable(self):
        calls["ref"] += 1
        return disable(self)

    monkeypatch.setattr(ActorEngine, "infer_batch", counting_infer)
    monkeypatch.setattr(ActorEngine, "disable_adapter", counting_disable)
    common = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", "train.steps=3"]
    common += ["output.plot=false", "output.tensorboard=false"]
    out = tmp_path / "kl_every_2"
    args = [*common, f"output.dir={out}", "train.kl_metric_every=2"]
    assert _run_in_process("grpo_lora", args) == 0
    assert calls == {"infer": 3 + 2, "ref": 2}  # an old pass per step; ref at steps 2 and 3
    records = read_metrics(out / "metrics.jsonl")
    assert [("kl" in r, "entropy" in r) for r in records[1:]] == [
        (False, True),
        (True, True),
        (True, True),
    ]

    calls.update(infer=0, ref=0)
    out = tmp_path / "bypass"
    args = [*common, f"output.dir={out}", "train.kl_metric_every=0"]
    assert _run_in_process("grpo_lora", [*args, "actor.policy_loss.bypass_mode=true"]) == 0
    assert calls == {"infer": 0, "ref": 0}
    records = read_metrics(out / "metrics.jsonl")
    assert not any("kl" in r or "entropy" in r for r in records)
    assert all("mismatch/abs_diff_max" in r and "loss" in r for r in records[1:])


def test_ctrl_c_saves_a_checkpoint_that_resume_continues(
    base_model: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "interrupted"
    args = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}"]
    cmd = [sys.executable, str(EXAMPLES / "grpo_lora.py"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*cmd, "train.steps=10000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(read_metrics(out / "metrics.jsonl")) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "continue with --resume" in output
    state = torch.load(out / "checkpoint" / "loop_state_rank0.pt", weights_only=True)
    saved = state["step"]
    assert saved >= 1 and read_metrics(out / "metrics.jsonl")[-1]["step"] == saved
    # The resumed run in-process (one interpreter start less): it continues after `saved`.
    assert _run_in_process("grpo_lora", [*args, f"train.steps={saved + 1}", "--resume"]) == 0
    assert f"at step {saved}" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(saved + 2))


def test_grpo_full_fine_tune_exports_the_trained_model(base_model: Path, tmp_path: Path) -> None:
    """actor.lora.rank=0: every weight trains (no KL, no reference), and the run exports the
    trained model itself, which transformers loads, with weights moved from the base's."""
    out = tmp_path / "full"
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)  # differs within every group
    args = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}"]
    full = [
        "actor.lora.rank=0",
        "train.kl_metric_every=0",
        f"task.rewards.functions=[{tmp_path / 'length_reward.py'}:length]",
    ]
    assert _run_in_process("grpo_lora", [*args, *full, "train.steps=2", "output.plot=false"]) == 0
    assert not (out / "adapter").exists() and is_checkpoint(out / "model")
    _, trained = load_pretrained(out / "model")
    _, base = load_pretrained(base_model)
    pairs = zip(trained.parameters(), base.parameters(), strict=True)
    moved = [not torch.equal(a, b) for a, b in pairs]
    assert all(moved), "a full fine-tune left weights untouched"


@pytest.mark.distributed
def test_grpo_runs_under_torchrun_on_two_ranks(base_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "dp"
    args = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}", "train.steps=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(EXAMPLES / "grpo_lora.py"), *args], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check_outputs(out, last_step=2)  # only rank 0 wrote them: one line per step
    assert result.stdout.count("held-out greedy accuracy:") == 1
    for rank in (0, 1):  # each rank saved its own loop state (prompt stream, RNG)
        assert (out / "checkpoint" / f"loop_state_rank{rank}.pt").is_file()
    _load_adapter(base_model, out / "adapter")


# ----------------------------------------------------------------------------- DAPO's knobs
DAPO = [
    "rollout.dynamic_sampling=true",
    "rollout.max_sampling_rounds=2",
    "task.rewards.overlong_buffer=2",
    "actor.mask_truncated=true",
    "output.plot=false",
    "output.tensorboard=false",
]


def test_grpo_trains_on_the_dynamic_groups_with_the_overlong_penalty(
    base_model: Path, tmp_path: Path, monkeypatch
) -> None:
    """With dynamic sampling the advantages come from the kept groups' task scores plus DAPO's
    overlong penalty of their responses (max_new_tokens 4, buffer 2: 0, 0, -0.5, -1 for 1-4
    tokens); the step logs the penalty's mean and the dynamic sampling counts."""
    from microrl.run import RolloutSource
    from microrl.tasks import overlong_penalty

    grpo = load_recipe("grpo_lora")
    sampled, rewards, trained = [], [], []
    real_sample, real_advantages = RolloutSource.take, grpo.group_advantages
    real_train = grpo.ActorEngine.train_batch

    def spy_sample(self, step):
        sampled.append(real_sample(self, step))
        return sampled[-1]

    def spy_advantages(rollout, scores, group_size):
        rewards.append(scores)
        return real_advantages(rollout, scores, group_size)

    def spy_train(self, batch, loss_fn=None):
        if self.peft_model is not None:  # not the warm start's full fine-tune
            trained.append("truncated" in batch)
        return real_train(self, batch, loss_fn)

    monkeypatch.setattr(RolloutSource, "take", spy_sample)
    monkeypatch.setattr(grpo, "group_advantages", spy_advantages)
    monkeypatch.setattr(grpo.ActorEngine, "train_batch", spy_train)
    out = tmp_path / "dapo"
    args = [*TINY_MODEL, *TINY_RL, *DAPO, f"model.path={base_model}", f"output.dir={out}"]
    assert _run_in_process("grpo_lora", [*args, "train.steps=2"]) == 0
    assert len(sampled) == len(rewards) == 2 and trained and all(trained)
    records = read_metrics(out / "metrics.jsonl")[1:]
    for (problems, rollout, scores, metrics), reward, record in zip(
        sampled, rewards, records, strict=True
    ):
        assert len(problems) == 4 and rollout.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        penalty = overlong_penalty(rollout.batch["loss_mask"].sum(1), 4, 2, 1.0)
        assert torch.equal(reward, scores + penalty)
        assert record["reward"] == pytest.approx(scores.mean().item())
        assert record["reward/overlong_penalty"] == pytest.approx(penalty.mean().item())
        truncated = rollout.batch["truncated"].float().mean().item()
        assert record["truncated_frac"] == pytest.approx(truncated)
        for key, value in metrics.items():
            assert record[key] == value, key
        assert 1 <= record["dynamic_sampling/rounds"] <= 2
        assert record["dynamic_sampling/groups_filled"] <= 4
        # The groups trained on whose rewards (score + penalty) are all equal: the top-up.
        equal = (reward.view(4, 2)[:, 0] == reward.view(4, 2)[:, 1]).float().mean().item()
        assert record["frac_reward_zero_std"] == pytest.approx(equal)


def test_ppo_adds_the_overlong_penalty_to_the_reward(base_model: Path, tmp_path: Path, monkeypatch):
    from microrl.tasks import overlong_penalty

    ppo = load_recipe("ppo_lora")
    seen = []
    real = ppo.estimate_advantages

    def spy(actor, critic, batch, scores, cfg, **kwargs):
        seen.append((batch["loss_mask"].sum(1), scores.clone()))
        return real(actor, critic, batch, scores, cfg, **kwargs)

    monkeypatch.setattr(ppo, "estimate_advantages", spy)
    out = tmp_path / "ppo_overlong"
    args = [*TINY_MODEL, *TINY_RL, *DAPO[2:], f"model.path={base_model}", f"output.dir={out}"]
    assert _run_in_process("ppo_lora", [*args, "train.steps=2"]) == 0
    records = read_metrics(out / "metrics.jsonl")[1:]
    for (lengths, rewards), record in zip(seen, records, strict=True):
        penalty = overlong_penalty(lengths, 4, 2, 1.0)
        task_scores = rewards - penalty
        assert set(task_scores.tolist()) <= {0.0, 1.0}  # the addition task's own scores
        assert record["reward"] == pytest.approx(task_scores.mean().item())
        assert record["reward/overlong_penalty"] == pytest.approx(penalty.mean().item())
        assert "truncated_frac" in record and "dynamic_sampling/rounds" not in record
        pairs = rewards.view(-1, 2)  # rows grouped by prompt, rollout.group_size=2
        equal = (pairs[:, 0] == pairs[:, 1]).float().mean().item()
        assert record["frac_reward_zero_std"] == pytest.approx(equal)


@pytest.mark.distributed
def test_grpo_dynamic_sampling_under_torchrun(base_model: Path, tmp_path: Path) -> None:
    """Both ranks sample as many rounds as the neediest one needs (the hf sampler generates
    collectively over FSDP2 shards): the run neither hangs nor changes the batch size."""
    out = tmp_path / "dp_dapo"
    args = [*TINY_MODEL, *TINY_RL, *DAPO, f"model.path={base_model}", f"output.dir={out}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [
            *cmd,
            str(EXAMPLES / "grpo_lora.py"),
            *args,
            "train.steps=2",
            "rollout.max_sampling_rounds=3",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_metrics(out / "metrics.jsonl")[1:]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert 1 <= record["dynamic_sampling/rounds"] <= 3
        assert "reward/overlong_penalty" in record and "loss" in record
