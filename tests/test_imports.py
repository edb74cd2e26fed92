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


def test_top_level_api() -> None:
    """``import microrl`` gives the API and the version, each name the object it stands for; the
    light packages stay light even though ``microrl/__init__`` runs first."""
    code = (
        "import sys, microrl\n"
        f"assert not [m for m in {HEAVY!r} if m in sys.modules], 'import microrl is not lazy'\n"
        "from importlib.metadata import version\n"
        "assert microrl.__version__ == version('microrl'), microrl.__version__\n"
        "from microrl import ActorEngine, CriticEngine, ActorConfig, SamplingParams, make_rollout\n"
        "import microrl.engine, microrl.configs, microrl.engine.rollout\n"
        "assert ActorEngine is microrl.engine.ActorEngine and CriticEngine is microrl.engine.CriticEngine\n"
        "assert ActorConfig is microrl.configs.ActorConfig\n"
        "assert make_rollout is microrl.engine.rollout.make_rollout\n"
        "for name in microrl.__all__:\n"
        "    assert getattr(microrl, name) is not None, name\n"
        "try:\n"
        "    microrl.NoSuchThing\n"
        "except AttributeError as err:\n"
        "    assert 'NoSuchThing' in str(err)\n"
        "else:\n"
        "    raise AssertionError('unknown names must raise AttributeError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
