"""Model and optimizer state dicts split into tensors (for DCP) and JSON (everything else):
DCP would pickle non-tensor entries. Keys are parameter FQNs, the same sharded or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
)

from microrl.engine.checkpoint.atomic_io import to_jsonable

__all__ = ["drop_aliases", "join_optimizer_state", "split_state", "tensor_specs"]


def split_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool
) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, str]]:
    """Model and optimizer state as ``(tensors, optimizer JSON, aliases)``: ``{"model": {fqn:
    tensor}, "optim": {fqn: {key: tensor}}}`` (DTensor shards under FSDP); the optimizer's class,
    param groups and non-tensor state; each dropped tied name -> the name kept."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model, options=options), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    model_sd, aliases = drop_aliases(model_sd)
    tensors: dict[str, Any] = {"model": model_sd}
    optim_json: dict[str, Any] | None = None
    if optim_sd is not None:
        tensor_state: dict[str, dict[str, torch.Tensor]] = {}
        scalar_state: dict[str, dict[str, Any]] = {}
        for fqn, entry in optim_sd["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensor_state.setdefault(fqn, {})[key] = value
                else:
                    scalar_state.setdefault(fqn, {})[key] = to_jsonable(value)
        tensors["optim"] = tensor_state
        optim_json = {
            "class": type(optimizer).__name__,
            "param_groups": to_jsonable(optim_sd["param_groups"]),
            "scalar_state": scalar_state,
        }
    return tensors, optim_json, aliases


def drop_aliases(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Keep one name per storage (tied embeddings: safetensors refuses shared tensors); returns the
    state and ``{alias: kept name}`` (loading the kept name fills the alias too)."""
    seen: dict[tuple, str] = {}
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = value
    return kept, aliases


def tensor_specs(tensors: Mapping[str, Any], prefix: str = "") -> dict[str, list]:
    """``{flattened key: [global shape, dtype name]}`` of a nested tensor dict (DCP's key names)."""
    out: dict[str, list] = {}
    for key, value in tensors.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(tensor_specs(value, name + "."))
        else:
            out[name] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return out


def join_optimizer_state(
    tensor_state: Mapping[str, Mapping[str, torch.Tensor]],
    saved: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Rebuild the FQN-keyed optimizer state dict from the loaded tensors and the JSON part
    (the inverse of :func:`split_state`); ``saved`` has as many param groups as ``optimizer``."""
    state = {fqn: dict(entry) for fqn, entry in tensor_state.items()}
    for fqn, entry in saved["scalar_state"].items():
        state.setdefault(fqn, {}).update(entry)
    groups = saved["param_groups"]
    restored = []
    for group, live in zip(groups, optimizer.param_groups, strict=True):
        # JSON turned tuples (Adam's betas) into lists: give each value its live type back.
        restored.append(
            {
                k: tuple(v) if isinstance(live.get(k), tuple) and isinstance(v, list) else v
                for k, v in group.items()
            }
        )
    return {"state": state, "param_groups": restored}
