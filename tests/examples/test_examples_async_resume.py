"""An asynchronous run (``rollout.max_staleness=1``) loses nothing when killed or stopped, with
either recipe (GRPO; PPO, whose checkpoint also holds the critic).

The run checkpoint holds the rollouts sampled ahead and the prompt stream's position after them.
One run is killed at step 3 (an error: nothing saved since step 2), resumed, stopped by Ctrl-C
at step 5 (saved there), and resumed to the end: every step's prompt group is trained exactly
once, in the uninterrupted run's order, and the resumed steps' metrics are the uninterrupted
run's (the worker draws each job's seed from the trainer's checkpointed RNG).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
from example_utils import async_run_args, load_example, load_recipe

from microrl.run import StepFailed, read_metrics, sample_rows

TIMINGS = ("tokens_per_s", "step_time", "staleness/take_wait_s")
STEPS = 6


class Killed(RuntimeError):
    pass


def _run(args: list[str], monkeypatch, recipe: str, *, kill_at=None, interrupt_at=None):
    """Run the recipe in process; the prompts of each step it trained, and its exit code."""
    module = load_example(recipe)
    trained: list[list[str]] = []

    def record(rollout, problems, scores, *rest):  # once per step, after its update
        trained.append([p.prompt for p in problems])
        if len(trained) == kill_at:
            raise Killed("the process dies here")
        if len(trained) == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: stop after this step
        return sample_rows(rollout, problems, scores, *rest)

    monkeypatch.setattr(load_recipe(recipe), "sample_rows", record)
    try:
        code = module.main(args)
    except StepFailed as err:
        assert isinstance(err.error, Killed)
        code = None
    assert not multiprocessing.active_children()  # the worker is gone, also after an error
    return trained, code


def _by_step(out: Path) -> dict[int, dict]:
    """The last record of each step (a resumed run rewrites the steps after its checkpoint)."""
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    return {s: {k: v for k, v in r.items() if k not in TIMINGS} for s, r in records.items()}


@pytest.mark.parametrize("recipe", ["grpo_lora", "ppo_lora"])
def test_kill_and_resume_trains_every_prompt_group_exactly_once(
    recipe: str, tmp_path: Path, monkeypatch
) -> None:
    steps = [a for a in async_run_args(tmp_path) if not a.startswith("train.steps=")]
    common = [*steps, "rollout.max_staleness=1", "output.save_every=2", f"train.steps={STEPS}"]
    full, code = _run([*common, f"output.dir={tmp_path / 'full'}"], monkeypatch, recipe)
    assert code == 0 and len(full) == STEPS

    out = tmp_path / "interrupted"
    args = [*common, f"output.dir={out}"]
    first, code = _run(args, monkeypatch, recipe, kill_at=3)
    assert code is None and len(first) == 3  # step 3 trained, but only step 2 was saved
    state = torch.load(out / "checkpoint" / "loop_state_rank0.pt", weights_only=True)
    assert state["step"] == 2
    ahead = state["extra"]["rollout_buffer"]["items"]
    assert [(item["step"], item["version"]) for item in ahead] == [(3, 1), (4, 2)]
    second, code = _run([*args, "--resume"], monkeypatch, recipe, interrupt_at=3)
    assert code == 130 and len(second) == 3  # steps 3, 4, 5; saved at 5
    state = torch.load(out / "checkpoint" / "loop_state_rank0.pt", weights_only=True)
    assert state["step"] == 5
    assert [item["step"] for item in state["extra"]["rollout_buffer"]["items"]] == [6]
    third, code = _run([*args, "--resume"], monkeypatch, recipe)
    assert code == 0 and len(third) == 1

    # Steps 1-2 of the killed run (step 3 was lost with it), then every resumed step.
    assert [*first[:2], *second, *third] == full
    resumed, uninterrupted = _by_step(out), _by_step(tmp_path / "full")
    assert resumed.keys() == uninterrupted.keys()
    for step, record in uninterrupted.items():
        assert resumed[step] == record, step
