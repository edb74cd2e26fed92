"""benchmarks/bench_gpu_step.py on a CPU in its smallest shape, so it cannot rot before a GPU
runs it: microrl's step and TRL's GRPOTrainer phase by phase (TRL from the ``test`` extra; CI
fails without it, elsewhere its runs are skipped and the output says so), the offload row's
save and resume bit-exact; and the ratios' direction against the goals."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gpu_step.py"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
TINY = ["--device", "cpu", "--sizes", "tiny", "--prompts", "2", "--samples", "2"]
TINY += ["--new-tokens", "4", "--prompt-tokens", "4", "--micro-batch", "2", "--mini-batch", "2"]
TINY += ["--steps", "1", "--pairs", "1"]


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_gpu_step
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_gpu_step


def test_the_tiny_step_runs_on_both_sides_and_resumes_bit_exact(tmp_path) -> None:
    have_trl = importlib.util.find_spec("trl") is not None
    if not have_trl and os.environ.get("CI"):
        pytest.fail("trl is not installed: the test extra installs it (pyproject.toml)")
    # The lora row on both sides and the offload row (the full row is the lora row's code
    # with rank 0: left out for time).
    command = [sys.executable, str(SCRIPT), *TINY, "--rows", "lora,offload"]
    command += ["--out-dir", str(tmp_path / "out"), "--json", str(tmp_path / "runs.json")]
    proc = subprocess.run(
        command, cwd=tmp_path, env=NO_GPU, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.startswith("device: CPU; 2 prompts x 2 samples x 4 new tokens"), out
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    sides = {(r["side"], r["row"]) for r in runs}
    want = {("microrl", "lora"), ("microrl", "offload")} | (
        {("trl", "lora")} if have_trl else set()
    )
    assert sides == want, sides
    for run in runs:
        for phase in ("generation", "old_logprobs", "update", "step"):
            assert run["phases"][phase]["s"] > 0, (run["side"], phase)
            assert run["phases"][phase]["peak_mib"] is None  # no CUDA: no device peak
        parts = sum(run["phases"][p]["s"] for p in ("generation", "old_logprobs", "update"))
        assert parts <= run["phases"]["step"]["s"], run  # phases lie within the step
        assert run["peak_rss_mib"] > 0
    (offload,) = [r for r in runs if r["row"] == "offload"]
    assert offload["resume"]["exact"] is True, offload["resume"]
    assert "| tiny | lora | microrl | " in out and "| RSS " in out
    last = out.rstrip().splitlines()[-1]
    if have_trl:
        assert "| tiny | lora | trl | " in out
        assert "tiny lora: training phases " in out and "TRL's tokens/s (goal >= 1.5x: " in out
        assert last.startswith("KEY: tiny lora ") and "offload resume bit-exact" in last, last
    else:
        assert "trl is not installed: TRL's runs are skipped" in out
        assert last == "KEY: offload resume bit-exact", last


def test_the_ratios_are_microrl_over_trl_against_the_goals() -> None:
    bench = _bench()

    def phases(old: float, update: float, peak: float) -> dict:
        out = {name: {"s": 1.0, "peak_mib": peak} for name in ("generation", "step")}
        out["old_logprobs"] = {"s": old, "peak_mib": peak}
        out["update"] = {"s": update, "peak_mib": peak / 2}
        return out

    # microrl's training phases take half TRL's time (2x its tokens/s) at half its memory.
    line, short = bench.ratio_line(phases(1.0, 2.0, 500.0), phases(2.0, 4.0, 1000.0))
    assert short == "2.00x tokens/s, 0.50x memory", short
    assert "(goal >= 1.5x: met)" in line and "(goal <= 0.6x: met)" in line, line
    line, short = bench.ratio_line(phases(2.0, 4.0, 1000.0), phases(1.0, 2.0, 500.0))
    assert short == "0.50x tokens/s, 2.00x memory", short
    assert line.count("not met") == 2, line


def test_each_pair_runs_microrl_then_trl_and_offload_on_microrl_alone() -> None:
    bench = _bench()
    args = type("Args", (), {"rows": ["lora", "full", "offload"], "sizes": ["0.5b", "1.5b"]})
    assert bench.plan(args) == [
        ("lora", "0.5b", "microrl"),
        ("lora", "0.5b", "trl"),
        ("lora", "1.5b", "microrl"),
        ("lora", "1.5b", "trl"),
        ("full", "0.5b", "microrl"),
        ("full", "0.5b", "trl"),
        ("offload", "0.5b", "microrl"),
    ]
