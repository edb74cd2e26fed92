"""Small filesystem helpers for checkpoints and exports: JSON, fsync, atomic directory swaps.

The swap (:func:`replace_dir`) is ``target -> .<name>.old`` then ``.<name>.tmp -> target``;
:func:`recover_swap` repairs a swap killed between them, and ``.old`` is deleted only while
``target`` exists, so no interrupted step loses the only complete copy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

__all__ = [
    "fsync_dir",
    "recover_swap",
    "refuse_foreign_dir",
    "replace_dir",
    "staging_paths",
    "to_jsonable",
    "write_json",
]


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples, paths -> plain JSON values; anything else is a ``TypeError``."""
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, Enum):
        return to_jsonable(value.value)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    torch = sys.modules.get("torch")  # no tensor exists unless torch was imported
    if torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot store a {type(value).__name__} as JSON: {value!r}")


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON and fsync it (it must be on disk before the directory is renamed)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (new files, renames) on filesystems that need it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_paths(target: Path) -> tuple[Path, Path]:
    """``(.<name>.tmp, .<name>.old)`` next to ``target``: the new version and the previous one."""
    return target.parent / f".{target.name}.tmp", target.parent / f".{target.name}.old"


def recover_swap(target: Path, is_complete: Callable[[Path], bool] | None = None) -> bool:
    """Finish or undo a :func:`replace_dir` killed between its renames, when ``target`` is missing:
    a ``.tmp`` that ``is_complete`` accepts is renamed into place, else ``.old`` back. Safe from
    several processes at once; returns whether ``target`` exists afterwards."""
    target = Path(target)
    if target.exists():
        return True
    tmp, old = staging_paths(target.absolute())
    if is_complete is not None and tmp.is_dir() and is_complete(tmp):
        source = tmp
    elif old.is_dir():
        source = old
    else:
        return False
    try:
        os.rename(source, target)
    except OSError:
        pass  # another process recovered it first (source is gone, or target now exists)
    else:
        fsync_dir(target.absolute().parent)
    if source == tmp and target.exists():
        shutil.rmtree(old, ignore_errors=True)  # superseded: the new copy is in place
    return target.exists()


def replace_dir(tmp: Path, target: Path, old: Path) -> None:
    """Move the complete directory ``tmp`` to ``target``; a previous ``target`` survives in ``old``
    until the new one is in place (and is moved back if moving ``tmp`` fails)."""
    moved_aside = target.exists()
    if moved_aside:
        shutil.rmtree(old, ignore_errors=True)  # superseded: target is the current copy
        os.rename(target, old)
    # else: an ``old`` left by an interrupted swap stays until the new copy is in place.
    try:
        os.rename(tmp, target)
    except BaseException:
        if moved_aside and not target.exists():
            os.rename(old, target)
        raise
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def refuse_foreign_dir(
    target: Path,
    is_ours: Callable[[Path], bool],
    what: str,
    error: type[Exception] = ValueError,
) -> None:
    """Raise ``error`` when ``target`` is a non-empty directory that is not ``what`` (replacing it
    would delete someone's files), after restoring an interrupted swap's ``.old``."""
    recover_swap(target)
    if target.is_dir() and any(target.iterdir()) and not is_ours(target):
        raise error(f"refusing to replace {target}: a non-empty directory that is not {what}")
