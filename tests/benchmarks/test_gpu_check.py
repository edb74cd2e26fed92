"""benchmarks/gpu_check.sh on a machine without CUDA: its syntax, its one-line exit, and its step
runner (timeouts, statuses, the summary table, the exit status) with stand-in steps.

The GPU steps themselves only run on a CUDA machine; CUDA_VISIBLE_DEVICES="" hides any GPU, so
these tests take the CPU path wherever they run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_gpu_check_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_gpu_check_shellcheck() -> None:
    proc = subprocess.run(
        ["shellcheck", "--severity=warning", str(SCRIPT)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "env",
    [NO_GPU, {**NO_GPU, "PYTHON": "/nonexistent/python3"}],
    ids=["no-visible-gpu", "no-torch"],
)
def test_gpu_check_without_cuda_exits_0_at_once(env, tmp_path) -> None:
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("no CUDA device") and proc.stdout.count("\n") == 1, proc.stdout
    assert elapsed < 60, f"{elapsed:.0f} s to find no CUDA device"
    assert not list(tmp_path.iterdir())  # nothing installed or written


RUNNER = r"""
source benchmarks/gpu_check.sh
init_run
ok() { echo "some output"; echo "KEY: fine | really"; }
bad() { echo "boom"; return 3; }
slow() { echo "started"; sleep 60; }
skipped() { echo "KEY: nothing to do"; return "$SKIP_RC"; }
run_step ok 30 ok
run_step bad 30 bad
run_step slow 2 slow
run_step skipped 30 skipped
BUDGET_S=$SECONDS  # the budget is spent: the next step is skipped, not run
run_step late 30 ok
print_summary
overall_status
echo "overall=$?"
"""


def test_gpu_check_runner_records_each_step(tmp_path) -> None:
    env = {**NO_GPU, "TMPDIR": str(tmp_path), "GPU_CHECK_LOGS": str(tmp_path / "logs")}
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", RUNNER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert time.monotonic() - start < 30, "the 2 s step timeout did not stop `sleep 60`"
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    table = (tmp_path / "logs" / "summary.md").read_text()
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ")}
    assert rows["ok"].startswith("| ok | pass | ") and rows["ok"].endswith("| fine / really |")
    assert rows["bad"].startswith("| bad | fail | ") and "exit 3: boom" in rows["bad"]
    assert rows["slow"].startswith("| slow | fail | ") and rows["slow"].endswith("after 2 s |")
    assert rows["skipped"].startswith("| skipped | skip | ") and "nothing to do" in rows["skipped"]
    assert rows["late"].startswith("| late | skip | 0 | no time left")
    assert table.strip() in out  # the table also ends the output
    assert "   | boom" in out  # a failed step's log tail is shown
    assert (tmp_path / "logs" / "ok.log").read_text().startswith("some output")
    assert out.rstrip().endswith("overall=1")  # a failed step: non-zero exit


def test_gpu_check_runner_passes_when_no_step_fails(tmp_path) -> None:
    script = "source benchmarks/gpu_check.sh; init_run; ok() { :; }; run_step ok 30 ok; "
    script += 'overall_status; echo "overall=$?"'
    env = {**NO_GPU, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.rstrip().endswith("overall=0"), proc.stdout + proc.stderr
