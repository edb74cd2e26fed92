"""The directory swap of checkpoints and exports survives a kill at every one of its steps.

A child process runs :func:`microrl.engine.checkpoint.atomic_io.replace_dir` and dies with ``os._exit`` just
before its k-th file-system operation (or halfway through a directory deletion); the parent then
checks that a complete copy is still there, that :func:`recover_swap` puts it back in place (the
previous version if the new one was not yet renamed into place, else the new one), and that the
next save works and leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from microrl.engine.checkpoint import save_load as ckpt
from microrl.engine.checkpoint.atomic_io import recover_swap, replace_dir, staging_paths

ROOT = Path(__file__).resolve().parents[3]
ATOMIC_IO = ROOT / "engine" / "checkpoint" / "atomic_io.py"

# Wraps os.rename and shutil.rmtree as atomic_io sees them: before operation KILL_AT (counted
# from 0) the process dies; "midway" first deletes half the files of the tree being removed.
KILL_HOOK = """
import os, shutil
from pathlib import Path

def install_kill_hook(module, kill_at, mode):
    ops = []

    def hook(name, path):
        ops.append(name)
        if len(ops) - 1 != kill_at:
            return
        if mode == "midway" and name == "rmtree" and Path(path).is_dir():
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            for p in files[: len(files) // 2 + 1]:
                p.unlink()
        os._exit(9)

    class Os:
        def __getattr__(self, name):
            return getattr(os, name)

        def rename(self, src, dst):
            hook("rename", src)
            os.rename(src, dst)

    class Shutil:
        def __getattr__(self, name):
            return getattr(shutil, name)

        def rmtree(self, path, *args, **kwargs):
            hook("rmtree", path)
            shutil.rmtree(path, *args, **kwargs)

    module.os, module.shutil = Os(), Shutil()
    return ops
"""

# atomic_io loaded on its own (it needs no torch): each child starts in a fraction of a second.
SWAP_CHILD = KILL_HOOK + textwrap.dedent(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("atomic_io", sys.argv[1])
    aio = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aio)
    ops = install_kill_hook(aio, int(sys.argv[2]), sys.argv[3])
    target = Path(sys.argv[4])
    tmp, old = aio.staging_paths(target)
    aio.replace_dir(tmp, target, old)
    print(" ".join(ops))
    """
)


def _write_version(path: Path, version: int, files: int = 4) -> None:
    """A directory like a checkpoint: data files, then a manifest (the completion marker)."""
    path.mkdir(parents=True)
    names = [f"part{i}.bin" for i in range(files)]
    for name in names:
        (path / name).write_bytes(bytes([version]) * 64)
    (path / "manifest.json").write_text(json.dumps({"version": version, "files": names}))


def _version(path: Path) -> int | None:
    """The version a complete directory holds; ``None`` for a missing or incomplete one."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return None
    meta = json.loads(manifest.read_text())
    if not all((path / name).is_file() for name in meta["files"]):
        return None
    return meta["version"]


def _run_child(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300
    )


# Starting states: (previous target, a copy in .old, the new complete copy in .tmp).
SCENARIOS = {
    # the usual save over a previous checkpoint
    "replace": {"target": 1, "old": None},
    # a superseded copy left in .old by a kill during the final deletion of an earlier swap
    "stale_old": {"target": 1, "old": "partial"},
    # the first save: nothing to replace
    "first": {"target": None, "old": None},
    # an earlier swap killed between its renames and not recovered: .old is the only copy
    "unrecovered": {"target": None, "old": 1},
}


def _setup(root: Path, scenario: dict) -> Path:
    target = root / "ckpt"
    tmp, old = staging_paths(target)
    if scenario["target"] is not None:
        _write_version(target, scenario["target"])
    if scenario["old"] == "partial":
        _write_version(old, 0)
        (old / "part0.bin").unlink()
    elif scenario["old"] is not None:
        _write_version(old, scenario["old"])
    _write_version(tmp, 2)
    return target


@pytest.mark.parametrize("roll_forward", [False, True], ids=["undo", "finish"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_swap_killed_at_any_step_keeps_a_complete_copy_and_recovers(
    tmp_path: Path, name: str, roll_forward: bool
) -> None:
    scenario = SCENARIOS[name]
    previous = scenario["target"] if scenario["target"] is not None else scenario["old"]
    is_complete = (lambda p: _version(p) is not None) if roll_forward else None
    # The operations of an uninterrupted swap, to kill before (or in the middle of) each one.
    target = _setup(tmp_path / "uninterrupted", scenario)
    done = _run_child(SWAP_CHILD, str(ATOMIC_IO), "-1", "before", str(target))
    assert done.returncode == 0, done.stderr
    ops = done.stdout.split()
    assert ops.count("rename") >= 1
    kill_points = [(k, "before") for k in range(len(ops))]
    kill_points += [(k, "midway") for k, op in enumerate(ops) if op == "rmtree"]
    for k, mode in kill_points:
        root = tmp_path / f"{k}_{mode}"
        target = _setup(root, scenario)
        tmp, old = staging_paths(target)
        killed = _run_child(SWAP_CHILD, str(ATOMIC_IO), str(k), mode, str(target))
        assert killed.returncode == 9, (k, mode, killed.stderr)
        where = f"{name}: killed {mode} operation {k} ({ops[k]})"
        # Never without a complete copy: the previous one or the new one.
        copies = {_version(p) for p in (target, tmp, old)} - {None}
        assert previous in copies or 2 in copies, where
        committed = not tmp.exists()  # the new copy was renamed into place
        finished = committed or (roll_forward and not target.exists())
        expected = 2 if finished else previous
        assert recover_swap(target, is_complete) == (expected is not None), where
        assert _version(target) == expected, where
        if finished and not committed:  # recovery finished the swap, its last step included
            assert not old.exists(), where
        # The next save works and leaves no staging directory behind.
        shutil.rmtree(tmp, ignore_errors=True)  # what a save does first with a leftover
        _write_version(tmp, 3)
        replace_dir(tmp, target, old)
        assert _version(target) == 3 and not tmp.exists() and not old.exists(), where


def test_a_swap_never_deletes_the_only_copy_before_the_new_one_is_in_place(tmp_path: Path) -> None:
    # .old is the only copy of the previous version (an earlier swap killed between its renames):
    # killed just before the new copy is renamed into place, the swap has kept it.
    target = _setup(tmp_path / "uninterrupted", SCENARIOS["unrecovered"])
    ops = _run_child(SWAP_CHILD, str(ATOMIC_IO), "-1", "before", str(target)).stdout.split()
    target = _setup(tmp_path / "killed", SCENARIOS["unrecovered"])
    tmp, old = staging_paths(target)
    killed = _run_child(SWAP_CHILD, str(ATOMIC_IO), str(ops.index("rename")), "before", str(target))
    assert killed.returncode == 9
    assert _version(old) == 1 and _version(tmp) == 2


# ----------------------------------------------------------------------------- engine checkpoints
CHECKPOINT_CHILD = KILL_HOOK + textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from microrl.engine import checkpoint
    from microrl.engine.checkpoint import atomic_io

    path, kill_at, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(2.0)
    install_kill_hook(atomic_io, kill_at, mode)
    checkpoint.save_checkpoint(path, model=model, step=2, rng=False)
    """
)


def _linear(value: float) -> nn.Linear:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return model


def _saved_weight(path: Path) -> float:
    model = _linear(-1.0)
    ckpt.load_checkpoint(path, model=model, rng=False)
    return model.weight[0, 0].item()


# replace_dir's operations in a save over a checkpoint: rmtree(.old), rename(target -> .old),
# rename(.tmp -> target), rmtree(.old). Killed before the second one: between the renames.
@pytest.mark.parametrize(
    ("kill_at", "mode", "step"),
    [(2, "before", 1), (3, "midway", 2)],
    ids=["between_the_renames", "while_deleting_the_old_copy"],
)
def test_an_engine_checkpoint_killed_in_its_swap_loads_and_saves_again(
    tmp_path: Path, kill_at: int, mode: str, step: int
) -> None:
    path = tmp_path / "ckpt"
    ckpt.save_checkpoint(path, model=_linear(1.0), step=1, rng=False)
    killed = _run_child(CHECKPOINT_CHILD, str(path), str(kill_at), mode)
    assert killed.returncode == 9, killed.stderr
    # The state a kill leaves, twice: one copy is recovered and loaded, the other saved over.
    shutil.copytree(tmp_path, tmp_path.parent / f"{tmp_path.name}_copy", symlinks=True)
    other = tmp_path.parent / f"{tmp_path.name}_copy" / "ckpt"

    recover_swap(path)
    assert ckpt.read_manifest(path)["step"] == step
    assert _saved_weight(path) == float(step)

    # A save straight after the kill, without recovering first, recovers by itself.
    ckpt.save_checkpoint(other, model=_linear(3.0), step=3, rng=False)
    other_tmp, other_old = staging_paths(other.absolute())
    assert ckpt.read_manifest(other)["step"] == 3 and _saved_weight(other) == 3.0
    assert not other_tmp.exists() and not other_old.exists()
