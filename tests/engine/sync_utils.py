"""The host-sync probe of the engine tests (test_engine_syncs.py says what it counts and why;
test_engine_sequence.py runs it on the reward model)."""

from __future__ import annotations

import collections
import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import microrl.engine.base
import microrl.kernels

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select"}
_BOOL_INDEX_OPS = {"index", "index_put", "index_put_"}
TORCH_DIR = str(Path(torch.__file__).parent)
ENGINE_DIR = str(Path(microrl.engine.base.__file__).parent)
KERNELS_DIR = str(Path(microrl.kernels.__file__).parent)


def _is_sync(func, args) -> bool:
    name = func.overloadpacket.__name__
    if name in _SYNC_OPS:
        return True
    if name in _BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class EngineSyncs(TorchDispatchMode):
    """Counts syncs whose innermost caller outside torch and this file is a file under ``dirs``,
    by ``file:line``."""

    def __init__(self, dirs: tuple[str, ...]) -> None:
        super().__init__()
        self.dirs = dirs
        self.sites: collections.Counter[str] = collections.Counter()

    def record(self) -> None:
        frames = [
            f
            for f in traceback.extract_stack()
            if not f.filename.startswith(TORCH_DIR) and f.filename != __file__
        ]
        if frames and frames[-1].filename.startswith(self.dirs):
            self.sites[f"{Path(frames[-1].filename).name}:{frames[-1].lineno}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_sync(func, args):
            self.record()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_syncs(dirs: tuple[str, ...] = (ENGINE_DIR, KERNELS_DIR)) -> Iterator[collections.Counter]:
    """The syncs issued inside the block from ``dirs``, by ``file:line``. ``Tensor.tolist`` is
    wrapped for the block: a CPU tensor's ``tolist`` reads memory without any dispatch."""
    mode = EngineSyncs(dirs)
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        mode.record()
        return tolist(tensor)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counted_tolist)
        with mode:
            yield mode.sites
