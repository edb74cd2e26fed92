"""Small filesystem helpers for checkpoints and exports: JSON, fsync, atomic directory swaps.

A directory is written under a temporary name next to its target and renamed into place only
when complete, so readers see either the previous complete directory or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "fsync_dir",
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
    if isinstance(value, torch.Tensor) and value.numel() == 1:
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


def replace_dir(tmp: Path, target: Path, old: Path) -> None:
    """Move ``tmp`` to ``target``; a previous ``target`` survives until the new one is in place
    (if moving ``tmp`` fails, the previous one is moved back before the error propagates)."""
    shutil.rmtree(old, ignore_errors=True)
    moved_aside = target.exists()
    if moved_aside:
        os.rename(target, old)
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
    it would delete someone's files."""
    if target.is_dir() and any(target.iterdir()) and not is_ours(target):
        raise error(f"refusing to replace {target}: a non-empty directory that is not {what}")
