"""The kernels and losses are importable on their own: no transformers, peft or accelerate; and
the library's imports point one way: never to the example configs, no cycle between packages."""

import ast
import itertools
import subprocess
import sys
import warnings
from pathlib import Path

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
        "from microrl import ActorEngine, CriticEngine, ActorConfig, SamplingParams, make_rollout_backend\n"
        "import microrl.engine, microrl.configs, microrl.engine.rollout\n"
        "assert ActorEngine is microrl.engine.ActorEngine and CriticEngine is microrl.engine.CriticEngine\n"
        "assert ActorConfig is microrl.configs.ActorConfig\n"
        "assert make_rollout_backend is microrl.engine.rollout.make_rollout_backend\n"
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


# ----------------------------------------------------------------------------- import direction
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
# Source directory -> the package it installs as (pyproject.toml's package-dir).
SOURCE_DIRS = {
    "microrl": "microrl",
    "engine": "microrl.engine",
    "kernels": "microrl.kernels",
    "losses": "microrl.losses",
    "configs": "microrl.configs",
}
EXAMPLE_CONFIGS = "microrl.configs.examples"
# The recipes (microrl/recipes/: the examples' bodies and the `microrl` command) are the one user
# of the example configs; nothing in the library imports them.
RECIPES = "microrl.recipes"


def _library_modules() -> dict[str, set[str]]:
    """Module name -> every name it imports, read with ``ast``: imports inside functions and
    relative ones count; ``from pkg import x`` counts ``pkg`` and ``pkg.x`` (x may be a module)."""
    modules = {}
    for directory, package in SOURCE_DIRS.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(ROOT / directory).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            names = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:  # relative to this module's package
                        anchor = parts if is_package else parts[:-1]
                        anchor = anchor[: len(anchor) - node.level + 1]
                        base = ".".join([*anchor, *([node.module] if node.module else [])])
                    names.add(base)
                    names.update(f"{base}.{alias.name}" for alias in node.names)
            modules[".".join(parts)] = names
    return modules


def _package(name: str) -> str | None:
    """``microrl.<package>`` that ``name`` lies in, or ``None`` outside microrl's subpackages."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "microrl" and len(parts) > 1 else None


def _importers(modules: dict[str, set[str]], target: str, allowed: str) -> dict[str, list[str]]:
    """The modules outside ``allowed`` (a package) that import ``target`` or a module in it."""
    offenders = {
        module: sorted(n for n in names if n == target or n.startswith(f"{target}."))
        for module, names in modules.items()
        if module != allowed and not module.startswith(f"{allowed}.")
    }
    return {module: names for module, names in offenders.items() if names}


def test_the_library_never_imports_the_example_configs() -> None:
    modules = _library_modules()
    assert EXAMPLE_CONFIGS in modules and len(modules) > 50, sorted(modules)  # the scan finds them
    assert EXAMPLE_CONFIGS in modules[f"{RECIPES}.grpo"]  # ... and the recipes' imports
    offenders = {
        **_importers(modules, EXAMPLE_CONFIGS, RECIPES),
        **_importers(modules, RECIPES, RECIPES),
    }
    offenders.pop(EXAMPLE_CONFIGS, None)
    offenders.pop("microrl.__main__", None)  # `python -m microrl`: the recipes' command
    assert not offenders, (
        f"library modules importing the example configs or the recipes: {offenders}"
    )


def test_packages_import_one_way() -> None:
    """No cycle between microrl's packages (run -> tasks, never tasks -> run; ...)."""
    modules = _library_modules()
    edges: dict[str, dict[str, list[str]]] = {}  # package -> package it imports -> by which modules
    for module, names in modules.items():
        source = _package(module)
        for name in names:
            target = _package(name)
            if source and target and target != source and target in modules:
                edges.setdefault(source, {}).setdefault(target, []).append(module)
    assert "microrl.tasks" in edges.get("microrl.run", {})  # the scan sees run -> tasks
    back = edges.get("microrl.tasks", {}).get("microrl.run")
    assert not back, f"microrl.tasks imports microrl.run in {sorted(set(back))}"

    def cycle_from(package: str, path: list[str]) -> list[str] | None:
        for target in sorted(edges.get(package, {})):
            if target in path:
                return [*path[path.index(target) :], target]
            found = cycle_from(target, [*path, target])
            if found:
                return found
        return None

    for package in sorted(edges):
        cycle = cycle_from(package, [package])
        if cycle:
            pairs = itertools.pairwise(cycle)
            where = "; ".join(f"{a} -> {b} in {sorted(set(edges[a][b]))}" for a, b in pairs)
            raise AssertionError(f"import cycle {' -> '.join(cycle)}: {where}")


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_a_deprecation_raised_from_a_microrl_module_fails_the_suite(category) -> None:
    # pyproject.toml's filterwarnings: a deprecated API called from microrl's own code is an
    # error in the tests; the same warning from a third-party module is not.
    with pytest.raises(category):
        warnings.warn_explicit("old API", category, "base.py", 1, module="microrl.engine.base")
    with warnings.catch_warnings(record=True):
        warnings.warn_explicit("old API", category, "x.py", 1, module="transformers.x")
