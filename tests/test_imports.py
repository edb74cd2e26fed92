"""The kernels and losses are importable on their own: no transformers, peft or accelerate; and
the library's imports point one way: never to the example configs, no cycle between packages,
and module by module along :data:`DIRECTIONS` (``engine/parallel/`` a leaf; the engine below
the recipes, the tasks and out-of-process sampling)."""

import ast
import functools
import itertools
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
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
        "import microrl.engine, microrl.configs, microrl.rollout\n"
        "assert ActorEngine is microrl.engine.ActorEngine and CriticEngine is microrl.engine.CriticEngine\n"
        "assert ActorConfig is microrl.configs.ActorConfig\n"
        "assert make_rollout_backend is microrl.rollout.make_rollout_backend\n"
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


@dataclass(frozen=True)
class Import:
    """One import in a library module: the module it names, and where."""

    name: str
    path: Path
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Rule:
    """Modules at or under ``source`` never import a module at or under ``target``, unless that
    module is at or under one of ``allowed``; ``why`` is said when a module does."""

    source: str
    target: str
    why: str
    allowed: tuple[str, ...] = ()


# The directions, module by module. A rule whose target does not exist yet holds as soon as it
# does. One line per rule: Rule(source, target, why).
DIRECTIONS = (
    Rule(
        "microrl.engine.parallel",
        "microrl.engine",
        "parallel/ is a leaf: the engine root imports it, never the reverse",
        allowed=("microrl.engine.parallel",),
    ),
    Rule("microrl.engine", "microrl.run", "the engine is a library; the recipes use it"),
    Rule("microrl.engine", "microrl.tasks", "the engine is a library; the tasks feed it"),
    Rule("microrl.engine", "microrl.rollout", "sampling builds on the engine, never the reverse"),
    Rule("microrl.tasks", "microrl.run", "the recipes use the tasks"),
    Rule("microrl.rollout", "microrl.run", "the recipes drive the samplers, never the reverse"),
    Rule("microrl.rollout", "microrl.agents", "the agents' endpoint sits in front of a sampler"),
    Rule("microrl.rollout", "microrl.tasks", "a task feeds the samplers; they know no task"),
    Rule("microrl.agents", "microrl.run", "the recipes run the agents, never the reverse"),
    Rule("microrl.agents", "microrl.tasks", "an agent task holds an agent; the endpoint no task"),
    Rule("microrl.engine", "microrl.agents", "the endpoint builds on the engine's samplers"),
    Rule(
        "microrl.rollout.vllm_plugin",
        "microrl.engine",
        "vLLM loads the plugin into every process it starts: it stays light",
    ),
)
# Deprecated re-exports of moved packages, kept for one release (docs/changelog.md): each imports
# the package it moved to, which no rule holds against it.
DEPRECATED_REEXPORTS = {
    "microrl.engine.rollout": "microrl.rollout",
    "microrl.remote": "microrl.rollout",
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(f"{prefix}.")


def scan(source_dirs: dict[Path, str]) -> dict[str, list[Import]]:
    """Module name -> every import in it, read with ``ast``: imports inside functions (lazy),
    relative ones and ``importlib.import_module("literal")`` count. ``from pkg import x`` names
    the module ``pkg.x`` when there is one, else ``pkg`` (x is an attribute of it)."""
    files = {}
    for directory, package in source_dirs.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(directory).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            files[".".join(parts)] = (path, is_package)
    return {
        module: _imports(path, module, is_package, files)
        for module, (path, is_package) in files.items()
    }


def _imports(path: Path, module: str, is_package: bool, known: dict) -> list[Import]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = (path, getattr(node, "lineno", 0))
        if isinstance(node, ast.Import):
            found += [Import(alias.name, *where) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to this module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append(Import(name if name in known else base, *where))
        elif isinstance(node, ast.Call) and _is_import_call(node):
            found.append(Import(node.args[0].value, *where))
    return sorted(set(found), key=lambda i: (i.line, i.name))


def _is_import_call(node: ast.Call) -> bool:
    """``importlib.import_module("a.b")``, ``import_module("a.b")`` or ``__import__("a.b")``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0] if node.args else None
    return (
        name in ("import_module", "__import__")
        and isinstance(first, ast.Constant)
        and isinstance(first.value, str)
        and not first.value.startswith(".")
    )


def violations(modules: dict[str, list[Import]], rule: Rule) -> list[Import]:
    """The imports by which a module of ``rule.source`` imports one of ``rule.target`` (and of
    none of ``rule.allowed``)."""
    return [
        found
        for module, imports in sorted(modules.items())
        if _under(module, rule.source) and module not in DEPRECATED_REEXPORTS
        for found in imports
        if _under(found.name, rule.target) and not any(_under(found.name, a) for a in rule.allowed)
    ]


@functools.cache
def _library_scan() -> dict[str, list[Import]]:
    return scan({ROOT / directory: package for directory, package in SOURCE_DIRS.items()})


def _library_modules() -> dict[str, set[str]]:
    """Module name -> the names of the modules it imports (:func:`scan` of the library), the
    deprecated re-exports left out (each imports the package it moved to)."""
    return {
        module: {i.name for i in imports}
        for module, imports in _library_scan().items()
        if module not in DEPRECATED_REEXPORTS
    }


def _package(name: str) -> str | None:
    """``microrl.<package>`` that ``name`` lies in, or ``None`` outside microrl's subpackages."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "microrl" and len(parts) > 1 else None


def test_the_scan_covers_every_source_directory() -> None:
    """Every directory pyproject.toml installs a package from is scanned: a new one (another
    package-dir) would otherwise escape every rule."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    declared = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, flags=re.MULTILINE))
    assert {directory: package for package, directory in declared.items()} == SOURCE_DIRS


@pytest.mark.parametrize("rule", DIRECTIONS, ids=lambda r: f"{r.source}-x->{r.target}")
def test_imports_point_one_way(rule: Rule) -> None:
    modules = _library_scan()
    assert any(_under(module, rule.source) for module in modules), f"no module {rule.source}"
    found = "\n".join(f"{i.where}: imports {i.name}" for i in violations(modules, rule))
    assert not found, f"{rule.source} never imports {rule.target} ({rule.why}):\n{found}"


def test_the_direction_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker on a synthetic tree: top-level, lazy, relative and ``import_module`` imports
    that break a rule are all reported, with their line; allowed and third-party ones are not."""
    sources = {
        "engine/__init__.py": "from microrl.engine.base import Engine\n",
        "engine/base.py": "from microrl.engine.parallel import leaf\n",
        "engine/parallel/__init__.py": "",
        "engine/parallel/leaf.py": (
            "import torch\n"
            "from microrl.engine.parallel import sibling\n"
            "from . import sibling as again\n"
            "from microrl.engine import Engine\n"  # 4: the root package itself
            "def lazy():\n"
            "    from microrl.engine.base import Engine\n"  # 6: inside a function
            "    from .. import base\n"  # 7: relative, up to the root
            "    return importlib.import_module('microrl.engine.base')\n"  # 8
        ),
        "engine/parallel/sibling.py": "import microrl.engine.parallel.leaf\n",
        "engine/sampler.py": (
            "def make():\n    from microrl.rollout.server import Server\n"  # 2
            "import microrl.run.recipe\n"  # 3
        ),
        "microrl/__init__.py": "",
        "microrl/rollout/__init__.py": "from microrl.engine import Engine\n",
        "microrl/rollout/server.py": "from microrl.run import recipe\n",
        "microrl/run/__init__.py": "",
        "microrl/run/recipe.py": "from microrl.rollout.server import Server\n",
    }
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = scan({tmp_path / "engine": "microrl.engine", tmp_path / "microrl": "microrl"})

    rules = {(rule.source, rule.target): rule for rule in DIRECTIONS}

    def found(source: str, target: str) -> list[tuple[str, str]]:
        """(file:line, module imported) of each import breaking the rule ``source -x-> target``:
        the rule of DIRECTIONS when there is one, else a new one (as rules get added)."""
        rule = rules.get((source, target), Rule(source, target, "a rule still to come"))
        return [(f"{i.path.name}:{i.line}", i.name) for i in violations(modules, rule)]

    assert found("microrl.engine.parallel", "microrl.engine") == [
        ("leaf.py:4", "microrl.engine"),
        ("leaf.py:6", "microrl.engine.base"),
        ("leaf.py:7", "microrl.engine.base"),
        ("leaf.py:8", "microrl.engine.base"),
    ]
    assert found("microrl.engine", "microrl.rollout") == [
        ("sampler.py:2", "microrl.rollout.server")
    ]
    assert found("microrl.engine", "microrl.run") == [("sampler.py:3", "microrl.run.recipe")]
    assert found("microrl.engine", "microrl.tasks") == []
    assert found("microrl.rollout", "microrl.run") == [("server.py:1", "microrl.run.recipe")]
    assert found("microrl.rollout", "microrl.engine") == [("__init__.py:1", "microrl.engine")]
    assert found("microrl.rollout.server", "microrl.engine") == []


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
    """No cycle between microrl's packages (run -> tasks, and DIRECTIONS forbids the reverse)."""
    modules = _library_modules()
    edges: dict[str, dict[str, list[str]]] = {}  # package -> package it imports -> by which modules
    for module, names in modules.items():
        source = _package(module)
        for name in names:
            target = _package(name)
            if source and target and target != source and target in modules:
                edges.setdefault(source, {}).setdefault(target, []).append(module)
    assert "microrl.tasks" in edges.get("microrl.run", {})  # the scan sees run -> tasks

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


@pytest.mark.parametrize(
    ("old", "name"),
    [("microrl.engine.rollout", "SamplingParams"), ("microrl.remote", "AsyncRollout")],
)
def test_a_moved_package_reexports_its_names_with_a_warning(old: str, name: str) -> None:
    import importlib

    moved = importlib.import_module(DEPRECATED_REEXPORTS[old])
    with pytest.warns(DeprecationWarning, match=f"import {name} from microrl.rollout"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(moved, name)
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = importlib.import_module(old).NoSuchThing


@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_a_deprecation_raised_from_a_microrl_module_fails_the_suite(category) -> None:
    # pyproject.toml's filterwarnings: a deprecated API called from microrl's own code is an
    # error in the tests; the same warning from a third-party module is not.
    with pytest.raises(category):
        warnings.warn_explicit("old API", category, "base.py", 1, module="microrl.engine.base")
    with warnings.catch_warnings(record=True):
        warnings.warn_explicit("old API", category, "x.py", 1, module="transformers.x")
