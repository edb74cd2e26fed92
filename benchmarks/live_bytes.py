"""Peak bytes of the tensors a block of code allocates, on any device (the CPU has no allocator
statistics): a ``TorchDispatchMode`` sees every operator's outputs, forward and backward.

Each output whose storage is new (not the storage of one of the operator's tensor arguments: views,
in-place and ``out=`` results reuse those) is counted until its storage is freed. ``peak`` is the
most counted bytes alive at once: the block's working set, allocations made before the block
excluded. Collectives (``all_reduce`` into an existing buffer) allocate nothing and count nothing.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as m: ...`` then ``m.peak`` (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for _, t in new_storages(args, kwargs, out):
            storage = t.untyped_storage()
            self._add(storage.nbytes())
            weakref.finalize(storage, self._add, -storage.nbytes())
        return out

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def _key(t) -> int | None:
    """The data pointer of a tensor's storage; None for non-tensors, empty or freed storages."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except RuntimeError:  # a storage released in place (FSDP2 frees unsharded parameters so)
        return None


def new_storages(args, kwargs, out):
    """``(key, tensor)`` of each output of an operator whose storage is new: not one of its
    arguments' (views, in-place and ``out=`` results) and not yielded before."""
    inputs = {_key(t) for t in tree_leaves((args, kwargs))}
    seen = set()
    for t in tree_leaves(out):
        key = _key(t)
        if key is None or key in inputs or key in seen:
            continue
        seen.add(key)
        yield key, t
