"""benchmarks/roofline_head.py on a tiny shape: it runs the GPU path on meta tensors, counts
what the predictions rest on, and prints its table.

The counted FLOPs are the algorithm's: 4 GEMMs (``8 N H V``) for the kernel, 3 for the fused
loss (its groups keep their tile at this size), the previous path's ~4 (it keeps tiles). The row
kernels are counted once per tile, the extra memory fits the budget, and the GPU path is
predicted faster than the previous one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from microrl.kernels import _chunk_plan

N, H, V = 96, 32, 1000


@pytest.fixture(scope="module")
def roofline():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "roofline_head.py"
    spec = importlib.util.spec_from_file_location("benchmarks_roofline_head", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flops(ops) -> float:
    return sum(op[1] for op in ops if op[1] > 2)  # the out_dtype probe's 1x1 matmul aside


def test_the_counted_work_is_the_algorithms(roofline):
    ops, extra = roofline.count("triton", N, H, V)
    assert _flops(ops) == 8 * N * H * V
    stats = [op for op in ops if op[0] == "triton_stats"]
    grads = [op for op in ops if op[0] == "triton_grads"]
    assert len(stats) == len(grads) >= 1
    # Each logit read once by the statistics kernel; read and written (bf16) by the gradient one.
    assert sum(op[2] for op in stats) >= 4 * N * V
    assert sum(op[2] for op in grads) >= 6 * N * V
    assert 0 < extra <= _chunk_plan.budget_bytes(N, V, H)
    fused, _ = roofline.count("fused", N, H, V)
    assert _flops(fused) == 6 * N * H * V  # one kept tile per group: no recompute
    tiles, _ = roofline.count("tiles", N, H, V)
    assert 6 * N * H * V <= _flops(tiles) <= 8 * N * H * V


def test_the_table_ranks_the_paths(roofline, capsys):
    results = roofline.main(["--cases", f"{N}x{H}x{V}"])
    rows = results[f"{N}x{H}x{V}"]
    out = capsys.readouterr().out
    assert "microrl GPU path (triton)" in out and "liger FLCE (op model)" in out
    for machine in roofline.MACHINES:
        gpu = rows["microrl GPU path (triton)"]["ms"][machine.name]
        assert rows["floor: 4 GEMMs"]["ms"][machine.name] < gpu
        assert gpu < rows["microrl tiles (previous CUDA path)"]["ms"][machine.name]
