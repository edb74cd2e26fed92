"""Rank-0 loading: a distributed engine reads its checkpoint once, never a full model per rank.

Rank 0 loads on the CPU, the others build on ``meta`` (:func:`load_on_rank0`); after sharding
the model is filled from rank 0 one broadcast tensor at a time (:func:`take_full_state`,
:func:`load_full_state`), equal to loading on every rank and sharding.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from microrl.engine.parallel import distributed

__all__ = [
    "FullState",
    "is_meta",
    "load_full_state",
    "load_on_rank0",
    "share_from_rank0",
    "take_full_state",
]


@dataclass
class FullState:
    """Rank 0's full (unsharded, CPU) tensors; empty on every other rank."""

    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def is_meta(module: nn.Module) -> bool:
    """True when ``module``'s parameters live on the meta device (built without memory)."""
    return any(p.is_meta for p in module.parameters())


def load_on_rank0(
    path: str | os.PathLike,
    dtype: torch.dtype,
    load: Callable[[str | os.PathLike, torch.dtype], nn.Module],
) -> nn.Module:
    """The checkpoint's model in ``dtype``: ``load(path, dtype)`` on the CPU on global rank 0, built
    on ``meta`` elsewhere from rank 0's broadcast configs (the path need not exist there).

    Raises:
        ValueError: on every rank, when rank 0 cannot load the path (naming it and rank 0's
            error), instead of rank 0 failing alone while the others wait in a collective.
    """
    model, found = None, None
    if distributed.rank() == 0:
        try:
            model = load(path, dtype)
            found = (type(model), model.config, getattr(model, "generation_config", None))
        except Exception as error:  # shared with the other ranks, then re-raised
            share_from_rank0(f"{type(error).__name__}: {error}")
            raise
    found = share_from_rank0(found)
    if isinstance(found, str):
        raise ValueError(f"model path {os.fspath(path)!r}: rank 0 could not load it ({found})")
    if model is not None:
        return model
    cls, config, generation_config = found
    # As the transformers auto classes' from_config builds a config.
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    model.generation_config = generation_config
    return model


def share_from_rank0(value):
    """``value`` as global rank 0 computed it (a picklable object), on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@torch.no_grad()
def take_full_state(module: nn.Module) -> FullState:
    """Rank 0: the full tensors, then the module on ``meta`` (call before sharding); others:
    empty."""
    if distributed.rank() != 0:
        return FullState()
    state = FullState(
        state_dict=dict(module.state_dict()),  # detached tensors: they keep their storage
        buffers={name: b.clone() for name, b in module.named_buffers()},
    )
    _to_meta(module)
    return state


def _to_meta(module: nn.Module) -> None:
    """Every parameter and buffer on ``meta`` in place, tied ones still tied (unlike ``.to``)."""
    memo: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in memo:
                    meta = torch.empty_like(tensor, device="meta")
                    if isinstance(tensor, nn.Parameter):
                        meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
                    memo[id(tensor)] = meta
                table[name] = memo[id(tensor)]


@torch.no_grad()
def load_full_state(module: nn.Module, state: FullState, device: torch.device) -> None:
    """Allocate the sharded ``module``'s local tensors on ``device`` and fill them from rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    module.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(module, state.state_dict, options=options)
    for name, buffer in module.named_buffers():
        local = buffer.to_local() if hasattr(buffer, "to_local") else buffer
        if distributed.rank() == 0:
            local.copy_(state.buffers[name])
        dist.broadcast(local, src=0)
