"""The GRPO recipe with ``rollout.max_staleness`` (asynchronous RL, docs/rollouts.md).

- ``max_staleness=0`` given explicitly is the synchronous loop: metrics.jsonl equal to a run
  with the default, key for key (timings aside), and no staleness or sync metrics.
- ``max_staleness=1`` trains on the same prompts in the same order, reports ``staleness/*``
  every step (at most 1, and 1 once under way) and ``sync/probe_*`` for every push, within the
  float32 tolerance; the recomputed old log-probs differ from the stale sampler's (the
  ``mismatch/*`` metrics show the lag), and the decoupled objective reports its weights.
- With dynamic sampling (DAPO) the steps filter rounds sampled ahead: the synchronous run's
  ``dynamic_sampling/*`` counts, consistent (every round's groups kept, dropped or surplus), plus
  the rounds the trainer waited for, and nothing older than k.
- A multi-turn task is played in the worker.
- Under ``torchrun`` every rank has its own worker (2 gloo ranks, FSDP2-sharded weights
  gathered for each push).
- The PPO recipe takes ``max_staleness=1`` the same way: the same prompts as its synchronous
  run, ``staleness/*`` and ``sync/probe_*`` as GRPO's, the critic trained on the stale rows.
The resume of an asynchronous run: tests/examples/test_examples_async_resume.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import async_run_args, run_recorded

from microrl.run import read_metrics

TIMINGS = ("tokens_per_s", "step_time")


@pytest.fixture(scope="module")
def common(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return async_run_args(tmp_path_factory.mktemp("async"))


def _run(args: list[str], monkeypatch, recipe: str = "grpo_lora"):
    return run_recorded(args, monkeypatch, recipe)


def _without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def test_k0_is_the_synchronous_loop_and_k1_trains_the_same_prompts_ahead(
    common, tmp_path: Path, monkeypatch
) -> None:
    prompts, default = _run([*common, f"output.dir={tmp_path / 'default'}"], monkeypatch)
    explicit_args = [*common, f"output.dir={tmp_path / 'k0'}", "rollout.max_staleness=0"]
    prompts_k0, explicit = _run(explicit_args, monkeypatch)
    assert prompts_k0 == prompts
    assert _without_timings(explicit) == _without_timings(default)
    assert not any(k.startswith(("staleness/", "sync/")) for r in default for k in r)

    async_args = [
        *common,
        f"output.dir={tmp_path / 'k1'}",
        "rollout.max_staleness=1",
        "actor.policy_loss.decoupled_is_cap=5.0",
    ]
    prompts_k1, records = _run(async_args, monkeypatch)
    assert prompts_k1 == prompts  # the same prompt stream, in the same order
    steps = records[1:]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["staleness/max"] for r in steps] == [0, 1, 1, 1]
    assert [r["staleness/mean"] for r in steps] == [0, 1, 1, 1]
    # Pushes: the base weights (checked at step 1) and those after steps 1 and 2 (the last
    # ones step 4 trains on); each checked once, at the first step that trains on it.
    checked = [r["step"] for r in steps if "sync/probe_kl" in r]
    assert checked == [1, 3, 4]
    for r in steps:
        if "sync/probe_kl" in r:
            assert r["sync/probe_abs_diff_max"] < 1e-4 and 0 <= r["sync/probe_kl"] < 1e-8
        assert r["decoupled_is_weight_mean"] > 0 and "decoupled_is_capped_frac" in r
    # The old log-probs are the trainer's at the current weights: a step-old sampler's differ
    # by the update (the synchronous run's only by float32 rounding).
    assert max(r["mismatch/abs_diff_max"] for r in _without_timings(default)[1:]) < 1e-4
    assert all(r["mismatch/abs_diff_max"] > 1e-4 for r in steps[1:])


def test_dynamic_sampling_filters_the_rounds_sampled_ahead(
    common, tmp_path: Path, monkeypatch
) -> None:
    # The length reward: groups whose responses have one length are equal (dropped or filled).
    args = [*common, "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3"]
    _, sync = _run([*args, f"output.dir={tmp_path / 'dyn_k0'}"], monkeypatch)
    async_args = [*args, f"output.dir={tmp_path / 'dyn_k1'}", "rollout.max_staleness=1"]
    trained, records = _run(async_args, monkeypatch)
    prompts = 4  # rollout.prompts_per_step
    for run in (sync[1:], records[1:]):
        for r in run:  # each round's groups are kept (filled ones too), dropped or surplus
            rounds = r["dynamic_sampling/rounds"]
            assert 1 <= rounds <= 3
            assert rounds * prompts == (
                prompts
                + r["dynamic_sampling/groups_dropped"]
                + r["dynamic_sampling/groups_surplus"]
            )
            assert 0 <= r["dynamic_sampling/groups_filled"] <= prompts
    keys = {k for r in sync[1:] for k in r if k.startswith("dynamic_sampling/")}
    async_keys = {k for r in records[1:] for k in r if k.startswith("dynamic_sampling/")}
    assert async_keys == keys | {"dynamic_sampling/rounds_waited"}
    assert [len(step) for step in trained] == [prompts] * 4  # every step trains its groups
    for r in records[1:]:
        assert 0 <= r["dynamic_sampling/rounds_waited"] < r["dynamic_sampling/rounds"]
        assert r["staleness/max"] <= 1
    assert any(r["staleness/max"] == 1 for r in records[1:])  # rounds sampled a step ahead
    assert any(r["dynamic_sampling/groups_dropped"] > 0 for r in records[1:])  # some filtered


def test_a_multi_turn_task_is_played_in_the_worker(common, tmp_path: Path, monkeypatch) -> None:
    args = [
        *[a for a in common if not a.startswith(("task.rewards", "train.steps"))],
        "task.name=hinted_addition",
        "rollout.max_turns=3",
        "rollout.max_episode_tokens=14",
        "rollout.max_staleness=1",
        "train.steps=2",
        f"output.dir={tmp_path / 'episodes'}",
    ]
    _, records = _run(args, monkeypatch)
    for r in records[1:]:
        assert r["episodes/turns_mean"] >= 1 and "staleness/max" in r
    assert records[-1]["staleness/max"] == 1


def test_ppo_samples_ahead_like_grpo(common, tmp_path: Path, monkeypatch) -> None:
    args = [*[a for a in common if not a.startswith("train.steps")], "train.steps=3"]
    prompts, sync = _run([*args, f"output.dir={tmp_path / 'ppo_k0'}"], monkeypatch, "ppo_lora")
    async_args = [
        *args,
        f"output.dir={tmp_path / 'ppo_k1'}",
        "rollout.max_staleness=1",
        "actor.policy_loss.decoupled_is_cap=5.0",
    ]
    prompts_k1, records = _run(async_args, monkeypatch, "ppo_lora")
    assert prompts_k1 == prompts  # the same prompt stream, in the same order
    steps = records[1:]
    assert [r["staleness/max"] for r in steps] == [0, 1, 1]
    assert [r["step"] for r in steps if "sync/probe_kl" in r] == [1, 3]  # base, after step 1
    for r in steps:
        if "sync/probe_kl" in r:
            assert r["sync/probe_abs_diff_max"] < 1e-4 and 0 <= r["sync/probe_kl"] < 1e-8
        assert r["decoupled_is_weight_mean"] > 0 and "critic/vf_loss" in r
    assert not any(k.startswith(("staleness/", "sync/")) for r in sync for k in r)
    assert all(r["mismatch/abs_diff_max"] > 1e-4 for r in steps[1:])  # the lag shows
    assert "eval/accuracy" in records[-1]


@pytest.mark.distributed
def test_every_rank_has_its_worker_under_torchrun(common, tmp_path: Path) -> None:
    out = tmp_path / "dp"
    args = [*common, f"output.dir={out}", "rollout.max_staleness=1"]
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    example = Path(__file__).resolve().parents[2] / "examples" / "grpo_lora.py"
    result = subprocess.run(
        [*launch, str(example), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.count("without a behaviour-policy correction") == 1  # rank 0 only
    steps = read_metrics(out / "metrics.jsonl")[1:]
    assert [r["staleness/max"] for r in steps] == [0, 1, 1, 1]
    assert [r["step"] for r in steps if "sync/probe_kl" in r] == [1, 3, 4]
    assert all(r["sync/probe_abs_diff_max"] < 1e-4 for r in steps if "sync/probe_kl" in r)
