"""The repository's layout rules, read from the source (nothing is imported).

- A test module never imports another test module: what tests share lives in ``*_utils.py``.
  Importing a test module runs its module-level set-up a second time and couples two test files.
- Every folder under tests/ mirrors a package folder (tests/engine/parallel/ tests
  engine/parallel/), or is declared below. A newcomer then finds a module's tests by its path.
- Module basenames are unique under tests/: without ``__init__.py`` files, pytest imports each
  test file by its basename.
- A module docstring of the library is at most ``MAX_DOCSTRING_LINES`` lines: a specification
  belongs in docs/, the docstring keeps the *why* and points there.

Each allow-list below names what is still to fix. An entry that no longer applies fails, so the
lists only shrink.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
LIBRARY = ("engine", "kernels", "losses", "configs", "microrl")
MAX_DOCSTRING_LINES = 25

# Test folders that test something other than a package folder: what each one tests.
NOT_PACKAGES = {
    "examples": "examples",
    "benchmarks": "benchmarks",
    "faults": "microrl",  # the whole product under kills and full disks (docs/faults.md)
}
# Test folders not yet where their package is (the rollout wing's move puts them in place).
MISPLACED: dict[str, str] = {}
# Test modules still importing another one (test module -> imported test module).
TEST_IMPORTS_TO_FIX: dict[str, set[str]] = {}
# Module docstrings still too long (the rollout wing's files; its move shrinks them).
LONG_DOCSTRINGS_TO_FIX: set[str] = set()


def _python_files(top: Path) -> list[Path]:
    return sorted(p for p in top.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _imported_test_modules(path: Path) -> set[str]:
    """The test modules ``path`` imports: by an import statement, or by ``import_module`` or
    ``__import__`` with a literal name. A module is a test module when a dotted part of its name
    starts with ``test_``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            if node.module is None:  # from . import test_x
                names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = getattr(func, "attr", None) or getattr(func, "id", None)
            first = node.args[0]
            if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
                names.add(str(first.value))
    return {n for n in names if any(part.startswith("test_") for part in n.split("."))}


def test_no_test_module_imports_another() -> None:
    found = {}
    for path in _python_files(TESTS):
        imported = _imported_test_modules(path)
        if imported:
            found[_rel(path)] = imported
    new = {p: m for p, m in found.items() if m - TEST_IMPORTS_TO_FIX.get(p, set())}
    assert not new, f"move what these test modules import into a *_utils.py module: {new}"
    stale = {p: m for p, m in TEST_IMPORTS_TO_FIX.items() if not m <= found.get(p, set())}
    assert not stale, f"fixed: remove from TEST_IMPORTS_TO_FIX: {stale}"


def test_the_probe_sees_each_kind_of_test_import(tmp_path: Path) -> None:
    """The scan above would pass on a blind probe: each form it must see, it sees."""
    sources = {
        "from test_other import helper": {"test_other"},
        "import test_other": {"test_other"},
        "def f():\n    from tests.engine.test_other import helper": {"tests.engine.test_other"},
        "import importlib\nimportlib.import_module('test_other')": {"test_other"},
        "from sync_utils import count_syncs\nimport testing_tools": set(),
    }
    for source, expected in sources.items():
        path = tmp_path / "test_probe.py"
        path.write_text(source)
        assert _imported_test_modules(path) == expected, source


def _package_folder(rel: Path) -> Path | None:
    """The package folder tests/``rel`` mirrors, or None: ``engine/parallel`` for engine/parallel
    (under a top-level package of the distribution), ``microrl/run`` for run."""
    top_level = ROOT / rel
    if (ROOT / rel.parts[0] / "__init__.py").is_file() and (top_level / "__init__.py").is_file():
        return top_level
    inner = ROOT / "microrl" / rel
    return inner if (inner / "__init__.py").is_file() else None


def _test_folders() -> list[Path]:
    folders = {p.parent.relative_to(TESTS) for p in _python_files(TESTS)}
    return sorted(f for f in folders if f.parts)


def test_every_test_folder_mirrors_a_package_folder() -> None:
    strays, misplaced = [], set()
    for rel in _test_folders():
        top = rel.parts[0]
        if top in NOT_PACKAGES:
            assert (ROOT / NOT_PACKAGES[top]).is_dir(), f"tests/{top} tests {NOT_PACKAGES[top]}/"
        elif rel.as_posix() in MISPLACED:
            misplaced.add(rel.as_posix())
        elif _package_folder(rel) is None:
            strays.append(f"tests/{rel.as_posix()}")
    assert not strays, f"test folders that mirror no package folder: {strays}"
    stale = set(MISPLACED) - misplaced
    assert not stale, f"moved: remove from MISPLACED: {sorted(stale)}"


def test_the_mirror_finds_package_folders_and_only_them() -> None:
    assert _package_folder(Path("engine/parallel")) == ROOT / "engine" / "parallel"
    assert _package_folder(Path("run")) == ROOT / "microrl" / "run"
    assert _package_folder(Path("engine/nowhere")) is None
    assert _package_folder(Path("benchmarks")) is None  # a folder, not a package
    assert _package_folder(Path("rollout")) == ROOT / "microrl" / "rollout"


def test_module_basenames_are_unique_under_tests() -> None:
    names = collections.defaultdict(list)
    for path in _python_files(TESTS):
        if path.name != "conftest.py":
            names[path.name].append(_rel(path))
    clashes = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not clashes, f"pytest would import one of these for the other: {clashes}"


def _docstring_lines(path: Path) -> int:
    """Source lines of the module docstring, its quotes included; 0 without one."""
    body = ast.parse(path.read_text(), str(path)).body
    first = body[0] if body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
        return 0
    if not isinstance(first.value.value, str):
        return 0
    return first.end_lineno - first.lineno + 1


def test_module_docstrings_are_short() -> None:
    long = {}
    for top in LIBRARY:
        for path in _python_files(ROOT / top):
            lines = _docstring_lines(path)
            if lines > MAX_DOCSTRING_LINES:
                long[_rel(path)] = lines
    allowed = {p: n for p, n in long.items() if p in LONG_DOCSTRINGS_TO_FIX}
    print(f"module docstrings over {MAX_DOCSTRING_LINES} lines, still allowed: {allowed}")
    new = {p: n for p, n in long.items() if p not in LONG_DOCSTRINGS_TO_FIX}
    assert not new, (
        f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the specification into "
        f"docs/, keep the why and a reference): {new}"
    )
    stale = sorted(LONG_DOCSTRINGS_TO_FIX - set(long))
    assert not stale, f"short or gone: remove from LONG_DOCSTRINGS_TO_FIX: {stale}"


def test_the_docs_index_lists_every_page() -> None:
    """docs/README.md is where a reader finds a page: each page of docs/ is linked from it."""
    index = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    missing = [page for page in pages if f"]({page})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"
