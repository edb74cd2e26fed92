"""The ``microrl`` command: the recipes for a package installed without the repository."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.recipes import RECIPES, main
from microrl.run import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = {"tokens_per_s", "step_time"}


def _exit(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_the_help_lists_the_recipes(capsys) -> None:
    code, out, _ = _exit(["--help"], capsys)
    assert code == 0 and out.startswith("usage: microrl")
    for name in ("grpo", "ppo"):
        assert f"\n  {name} " in out, out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sft"], "unknown recipe 'sft': choose grpo or ppo (microrl --help)"),
        ([], "the following arguments are required: RECIPE"),
        (["train.steps=3", "grpo"], "unknown recipe 'train.steps=3'"),
    ],
)
def test_a_missing_or_unknown_recipe_is_an_error_naming_the_choices(argv, message, capsys):
    code, _, err = _exit(argv, capsys)
    assert code == 2 and f"microrl: error: {message}" in err, err


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_a_recipes_help_shows_the_commands_launch_lines_and_every_key(name, capsys) -> None:
    code, out, _ = _exit([name, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: microrl {name} "), out[:200]
    assert f"    microrl {name} --resume" in out  # its launch lines, not the example's
    assert f"What {name.upper()} does" in out and "actor.optim.lr=" in out
    assert "examples/" not in out.split("What")[0]
    # The script prints its own launch lines above the same recipe's text.
    code, script_out, _ = _exit_example(f"{name}_lora", capsys)
    assert code == 0 and f"python examples/{name}_lora.py --resume" in script_out
    assert out.split(f"What {name.upper()} does (")[1] in script_out


def _exit_example(name: str, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        load_example(name).main(["--help"])
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_a_bad_override_names_the_command(capsys) -> None:
    code, _, err = _exit(["ppo", "train.no_such_key=1", "--print-config"], capsys)
    assert code == 2 and err.startswith("microrl ppo: error: ") and "train.no_such_key" in err


def test_python_dash_m_microrl_is_the_command() -> None:
    """``python -m microrl`` (as ``torchrun -m microrl`` starts each rank) from outside the
    repository."""
    result = subprocess.run(
        [sys.executable, "-m", "microrl", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: microrl") and "\n  ppo " in result.stdout


def test_the_installed_script_is_this_command_and_its_packages_are_installed() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, function = project["project"]["scripts"]["microrl"].partition(":")
    assert (module, function) == ("microrl.recipes", "main")
    listed = set(project["tool"]["setuptools"]["packages"])
    for name, (recipe_module, _) in RECIPES.items():
        assert recipe_module.rpartition(".")[0] in listed, name
    # Every package of microrl/ is installed (a recipe a wheel lacked would fail only there).
    found = {
        ".".join(("microrl", *p.parent.relative_to(ROOT / "microrl").parts))
        for p in (ROOT / "microrl").rglob("__init__.py")
    }
    assert found <= listed, sorted(found - listed)


def test_the_command_runs_the_examples_recipe(tmp_path: Path) -> None:
    """``microrl grpo ARGS`` and ``python examples/grpo_lora.py ARGS`` write the same metrics
    (but for timings): one recipe behind both."""
    args = [*TINY_MODEL, *TINY_RL, f"model.path={tmp_path / 'base'}", "train.steps=2"]
    args += ["output.plot=false", "output.tensorboard=false"]
    assert load_example("grpo_lora").main([*args, f"output.dir={tmp_path / 'script'}"]) == 0
    assert main(["grpo", *args, f"output.dir={tmp_path / 'command'}"]) == 0
    runs = [read_metrics(tmp_path / run / "metrics.jsonl") for run in ("script", "command")]
    script, command = ([{k: v for k, v in r.items() if k not in TIMINGS} for r in x] for x in runs)
    assert [r["step"] for r in command] == [0, 1, 2] and command == script
