"""Small filesystem helpers for checkpoints and exports: JSON, fsync, atomic directory swaps.

A directory is written under a temporary name next to its target and renamed into place only
when complete, so readers see either the previous complete directory or the new one.

The swap (:func:`replace_dir`) is two renames, ``target -> .<name>.old`` then
``.<name>.tmp -> target``; a process killed between them leaves ``target`` missing and the
previous copy in ``.<name>.old``. :func:`recover_swap` puts it back (or, given a test of the
completion marker, renames a complete ``.tmp`` into place), and :func:`replace_dir` deletes
``.old`` only while ``target`` exists, so whenever ``target`` is missing an ``.old`` that exists is
complete: no step of the swap, interrupted, loses the only complete copy.
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
    """``(.<name>.tmp, .<name>.old)`` next to ``target``: where a new version is written, and
    where the previous one waits during the swap."""
    return target.parent / f".{target.name}.tmp", target.parent / f".{target.name}.old"


def recover_swap(target: Path, is_complete: Callable[[Path], bool] | None = None) -> bool:
    """Finish or undo a :func:`replace_dir` that a killed process left between its two renames.

    Only acts when ``target`` is missing. With ``is_complete`` (a test of the directory's
    completion marker, e.g. a checkpoint's manifest) a complete ``.<name>.tmp`` is renamed into
    place (the newest copy: the swap is finished) and ``.old`` deleted after; otherwise
    ``.<name>.old`` is renamed back (the swap is undone; ``.old`` is complete: it is deleted only
    while ``target`` exists). Without ``is_complete`` a ``.tmp`` is never trusted: it is left for
    the next save to clear. Safe to call from several processes at once (a rename another process
    already did is not an error). Returns whether ``target`` exists afterwards.
    """
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
    """Move the complete directory ``tmp`` to ``target``; a previous ``target`` survives until the
    new one is in place (if moving ``tmp`` fails, the previous one is moved back before the error
    propagates).

    Steps: delete a superseded ``old`` (only while ``target`` exists), ``target -> old``,
    ``tmp -> target``, delete ``old``. Killed at any point, ``target`` holds a complete copy, or
    is missing with the previous one in ``old`` and the new one in ``tmp`` (:func:`recover_swap`).
    """
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
    """Raise ``error`` when ``target`` is a non-empty directory that is not ``what``: replacing
    it would delete someone's files.

    Called before every save and export, it first restores a copy that an interrupted swap left
    in ``.<name>.old`` (:func:`recover_swap`, which trusts no ``.tmp`` here: ``is_ours`` is not a
    completeness test), so the check sees the previous version and the save replaces it.
    """
    recover_swap(target)
    if target.is_dir() and any(target.iterdir()) and not is_ours(target):
        raise error(f"refusing to replace {target}: a non-empty directory that is not {what}")
