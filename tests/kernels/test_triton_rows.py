"""The Triton row kernels under Triton's interpreter: tests/kernels/triton_interpreted.py in a
pytest process of its own started with ``TRITON_INTERPRET=1``.

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


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_row_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [str(HERE / "triton_interpreted.py")]
    out = subprocess.run(
        cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=900, check=False
    )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.split("\n")[-2], out.stdout
