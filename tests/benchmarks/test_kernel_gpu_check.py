"""The GPU check's kernel steps run on a CPU: ``kernel_cuda_check.py`` (its checks on tiny shapes,
with the GPU path's torch row ops) and the bench step's key line, which fails when microrl did
not run its GPU path (TRL #7253: a fast path silently not taken)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench_kernel():
    spec = importlib.util.spec_from_file_location("bench_kernel", BENCHMARKS / "bench_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(seconds: float, extra: int, ran=None) -> dict:
    out = {"times": [seconds] * 3, "cpu": [seconds] * 3, "extra_bytes": extra}
    return {**out, "ran": ran} if ran else out


def test_the_key_line_gives_the_ratios_and_fails_without_the_gpu_path():
    key_figure = _bench_kernel().key_figure
    per = {
        "matmul": _result(0.01, 0),
        "eager": _result(0.5, 10 << 30),
        "microrl": _result(0.06, 100 << 20, "triton"),
        "microrl-fused": _result(0.05, 200 << 20, "triton"),
        "liger": _result(0.08, 150 << 20),
    }
    line, ok = key_figure({"8192x3584x152064:bfloat16": per})
    assert ok, line
    assert line == (
        "KEY: 8192x3584x152064 microrl/liger (triton): time 0.75x, extra peak memory 0.67x, "
        "fused loss 0.62x, 1.50x the floor"
    )
    per["microrl"] = _result(0.15, 2 << 30, "tiles")
    line, ok = key_figure({"8192x3584x152064:bfloat16": per})
    assert not ok and "microrl ran tiles" in line


def test_the_kernel_check_runs_its_cases_on_a_cpu():
    cmd = [sys.executable, str(BENCHMARKS / "kernel_cuda_check.py"), "--device", "cpu"]
    cmd += ["--implementation", "chunks", "--quick"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "KEY: chunks implementation ran; within tolerance of float64" in out.stdout
    assert out.stdout.count("\nok ") >= 16
