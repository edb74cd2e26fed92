"""The Triton row kernels under Triton's interpreter (tests/kernels/triton_interpreted.py in a
pytest process of its own started with ``TRITON_INTERPRET=1``), and compiled for an H100 without
a GPU (tests/kernels/triton_compiled.py: the compiler's checks, which the interpreter skips).

Triton reads that variable when its modules are imported (its ``tl.zeros``, ``tl.sum`` are
``@triton.jit`` functions decorated then), and this process may have imported Triton already
(the dispatch rule imports it for CUDA tensors, simulated ones included), so the interpreted
tests cannot share it. Skipped where Triton is not installed (it is an optional dependency, in
the ``cuda`` and ``test`` extras).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


NO_TRITON = importlib.util.find_spec("triton") is None


@pytest.mark.skipif(NO_TRITON, reason="triton is not installed")
def test_the_triton_row_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [str(HERE / "triton_interpreted.py")]
    out = subprocess.run(
        cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900, check=False
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.split("\n")[-2], out.stdout


@pytest.mark.skipif(NO_TRITON, reason="triton is not installed")
def test_the_triton_row_kernels_compile_for_an_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when it is unset
    out = subprocess.run(
        [sys.executable, str(HERE / "triton_compiled.py")], env=env, capture_output=True,
        text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("PTX words") == 8, out.stdout
