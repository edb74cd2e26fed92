"""The kernels and losses are importable on their own: no transformers, peft or accelerate."""

import subprocess
import sys

import pytest

HEAVY = ("transformers", "peft", "accelerate")


@pytest.mark.parametrize("package", ["microrl.kernels", "microrl.losses"])
def test_light_packages_do_not_import_heavy_dependencies(package: str) -> None:
    code = (
        f"import sys, {package}\n"
        f"loaded = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not loaded, f'imported {loaded}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ci_runs_the_readme_test_command() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ci_lines = (root / ".ci" / "run").read_text().splitlines()
    command = ci_lines[ci_lines.index("# README: tests") + 1]
    assert command in (root / "README.md").read_text()
