"""Rank-0 loading: a distributed engine reads its checkpoint once, never a full model per rank.

A model given as a checkpoint path to an engine under ``torchrun`` (data parallel, tensor
parallel, or both) is set up like this, so that no rank other than global rank 0 ever holds the
whole model, and no rank holds it on its accelerator:

1. global rank 0 loads the checkpoint on the CPU; every other rank builds the same architecture
   on the ``meta`` device (no memory) from rank 0's config, sent to it (:func:`load_on_rank0`:
   only rank 0 reads the path);
2. every rank prepares the model identically (dropout off, LoRA, checkpointing, the role's
   wrapper: a critic's value head, the policy head's probe, run on rank 0 and shared);
3. rank 0 takes the full state out of its model (:func:`take_full_state`: every parameter and
   buffer, LoRA and value-head initialisations included) and turns the model into ``meta`` too;
4. the meta model is sharded (tensor-parallel DTensors with no communication, FSDP2 units) and
   materialised on the device as shards only (``to_empty``), then filled from rank 0
   (:func:`load_full_state`): ``set_model_state_dict(..., broadcast_from_rank0=True)`` broadcasts
   one full tensor at a time and each rank keeps its slice; buffers (also the non-persistent ones
   such as rotary frequencies, absent from state dicts) are broadcast as they are.

The result equals loading the model on every rank and sharding it (tested in
tests/engine/parallel/: ``test_tensor_parallel.py``, ``test_distributed.py``). A model passed as
an ``nn.Module`` was already built by the caller on every rank and is sharded as it is.
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
    """The checkpoint's model in ``dtype`` (the engine's ``base_dtype``): ``load(path,
    dtype)`` on the CPU on global rank 0 (the engine passes its role's loader: a causal LM,
    ``setup.load_causal_lm``, which checks for a local directory; a reward model's classifier),
    built on ``meta`` elsewhere as the same class from rank 0's config and generation config
    (shared by a broadcast, so the other ranks never read the path: on a multi-node run it need
    not exist on their file systems).

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
    # The class rank 0 loaded (a causal LM, an image-text model, a classifier), built as the
    # transformers auto classes build a config (their from_config calls it).
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
    """Rank 0: the module's full tensors, then the module itself on ``meta``; other ranks: their
    module is meta already. Call before sharding."""
    if distributed.rank() != 0:
        return FullState()
    state = FullState(
        state_dict=dict(module.state_dict()),  # detached tensors: they keep their storage
        buffers={name: b.clone() for name, b in module.named_buffers()},
    )
    _to_meta(module)
    return state


def _to_meta(module: nn.Module) -> None:
    """Every parameter and buffer of ``module`` on ``meta``, in place, keeping shared ones shared
    (``module.to("meta")`` would give a tied embedding and lm head two new parameters)."""
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
