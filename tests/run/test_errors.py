"""What a user sees when a run stops or fails: one clear line each.

- the first Ctrl-C says the run stops after this step (and that a second one aborts);
- an error while the script runs is one line (what failed, at which step, the message), the
  traceback only with ``--debug``; an environment's or a reward's error in the evaluation before
  the first step says ``evaluation at step 0``;
- a refused ``output.dir`` under ``torchrun`` is one line on rank 0, and exit code 2 on every rank
  (torchrun then reports the failed processes in its own words).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import config_to_yaml, load_config
from microrl.rollout.episodes import EpisodeError
from microrl.run import Dist, StepFailed, StopOnInterrupt, parse_cli, start_tracking
from microrl.run.cli import _one_line_error
from microrl.run.dist import STOP_MESSAGE
from microrl.tasks import RewardError

ROOT = Path(__file__).resolve().parents[2]
TINY = [*TINY_MODEL, *TINY_RL, "output.tensorboard=false", "output.plot=false"]
HINT = "(--debug prints the traceback)"

# A script's loop as the recipes run it, with no model: Ctrl-C stops it after the step it is in.
LOOP = """
import sys, time
from microrl.configs.examples import GRPOExampleConfig
from microrl.run import Dist, StopOnInterrupt, parse_cli
parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "loop", [])
with StopOnInterrupt(Dist()) as stop:
    for step in stop.steps(1, 10_000):
        if step == 1:
            print("ready", flush=True)
        time.sleep(float(sys.argv[1]))
        if stop.should_stop():
            print(f"stopped after step {step}", flush=True)
            break
"""


def _start_loop(step_seconds: float, cwd: Path, *, sigint_ignored: bool = False):
    # sigint_ignored: started as `nohup cmd &` starts it, with SIGINT ignored.
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    loop = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(step_seconds)],
        preexec_fn=ignore,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert loop.stdout.readline() == "ready\n", loop.communicate(timeout=60)
    return loop


def test_the_first_ctrl_c_says_it_stops_after_this_step(tmp_path: Path) -> None:
    loop = _start_loop(0.02, tmp_path)
    loop.send_signal(signal.SIGINT)
    out, err = loop.communicate(timeout=120)
    assert loop.returncode == 0, err
    assert err.splitlines() == [STOP_MESSAGE]
    assert out.startswith("stopped after step ")
    assert STOP_MESSAGE == "stopping after this step; Ctrl-C again to abort without saving"


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_a_second_ctrl_c_aborts_in_one_line(tmp_path: Path, sigint_ignored: bool) -> None:
    # A long step: the second Ctrl-C comes inside it.
    loop = _start_loop(60.0, tmp_path, sigint_ignored=sigint_ignored)
    loop.send_signal(signal.SIGINT)
    # The second only once the first was handled: two signals arriving before Python's handler
    # runs (a loaded machine) are handled once.
    first = loop.stderr.readline()
    loop.send_signal(signal.SIGINT)
    out, rest = loop.communicate(timeout=120)
    err = first + rest
    assert loop.returncode in (130, -signal.SIGINT), (loop.returncode, err)
    assert err.splitlines() == [
        STOP_MESSAGE,
        f"aborted by a second Ctrl-C: nothing saved after the last checkpoint {HINT}",
    ]
    assert "stopped" not in out


def test_only_rank_0_says_it(capfd) -> None:
    for rank, expected in ((0, f"{STOP_MESSAGE}\n"), (1, "")):
        stop = StopOnInterrupt(Dist(rank=rank, world_size=2))
        with stop:
            stop._handler(signal.SIGINT, None)
            assert stop.requested
        assert capfd.readouterr().err == expected


def test_an_error_in_the_loop_names_its_step() -> None:
    with pytest.raises(StepFailed) as info, StopOnInterrupt(Dist()) as stop:
        for step in stop.steps(4, 10):
            if step == 6:
                raise ZeroDivisionError("division by zero")
    assert info.value.step == 6 and isinstance(info.value.__cause__, ZeroDivisionError)


def test_errors_are_one_line_unless_debug(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "test", ["--debug"])
    assert sys.excepthook is sys.__excepthook__  # --debug: Python's traceback
    parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "test", [])
    hook = sys.excepthook
    assert hook is not sys.__excepthook__
    capsys.readouterr()
    # A dataset problem at setup (no step yet), on one process and on rank 1 of 2.
    error = ValueError("task.dataset.train_file='data/missing.jsonl' does not exist\nsecond line")
    hook(ValueError, error, None)
    assert capsys.readouterr().err == (
        f"error: ValueError: task.dataset.train_file='data/missing.jsonl' does not exist {HINT}\n"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    hook(StepFailed, StepFailed(3, KeyError("answer")), None)
    assert capsys.readouterr().err == f"[rank 1] error at step 3: KeyError: 'answer' {HINT}\n"
    hook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert "aborted by a second Ctrl-C" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("error", "shown"),
    [  # an environment's message is shown whole (its traceback), a reward's with its type
        (EpisodeError("the environment of row 3 (prompt 3) raised in step() at turn 1"), ""),
        (RewardError("task.rewards.functions[0]='boom.py:score' raised KeyError"), "RewardError: "),
    ],
)
def test_an_error_in_the_step_0_evaluation_names_it(tmp_path: Path, capsys, error, shown) -> None:
    # The starting evaluation runs before the step loop: no StepFailed names its step.
    cfg = load_config(GRPOExampleConfig, None, [f"output.dir={tmp_path}", *TINY[-2:]])

    def evaluate() -> float:
        raise error

    with pytest.raises(type(error)) as info:
        start_tracking(cfg, Dist(), 0, evaluate, 0.0)
    assert str(info.value) == f"evaluation at step 0: {error}"
    assert info.value.__cause__ is error
    capsys.readouterr()
    _one_line_error(type(info.value), info.value, None)
    assert capsys.readouterr().err.startswith(f"error: {shown}evaluation at step 0: {error}")


# Raises on a rollout's 8 rows (4 prompts x 2), not on the warm start's or evaluations' rows.
BOOM = """
def score(completions, answers):
    if len(completions) == 8:
        return 1 / 0
    return [0.0] * len(completions)
"""


def test_a_reward_that_raises_is_one_line_with_its_step(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "boom.py").write_text(BOOM)
    args = [*TINY, f"model.path={tmp_path / 'base'}", "task.rewards.functions=boom.py:score"]
    args.append("task.eval_size=6")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_lora.py"), *args, "output.dir=run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        "error at step 1: RewardError: task.rewards.functions[0]='boom.py:score' raised "
        f"ZeroDivisionError: division by zero {HINT}"
    )
    # --debug: the exception itself (Python prints its traceback), chained to the reward's.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    with pytest.raises(StepFailed) as info:
        load_example("grpo_lora").main([*args, "output.dir=run_debug", "--debug"])
    assert sys.excepthook is sys.__excepthook__
    assert info.value.step == 1 and isinstance(info.value.error.__cause__, ZeroDivisionError)


def test_a_refused_output_dir_under_torchrun_is_one_line_on_rank_0(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "config.yaml").write_text(config_to_yaml(load_config(GRPOExampleConfig)))
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets for each of 2 ranks
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as info:  # a clean exit, no traceback
            parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "GRPO", [f"output.dir={out}"])
        assert info.value.code == 2
        captured = capsys.readouterr()
        if rank == 0:
            assert len(captured.err.splitlines()) == 1, captured.err  # no usage block
            assert f": error: output.dir={out} holds a previous run" in captured.err
            assert "--resume" in captured.err and "--overwrite" in captured.err
        else:
            assert captured.err == ""
        assert captured.out == ""
