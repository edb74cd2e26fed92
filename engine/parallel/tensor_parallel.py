"""Tensor parallelism (TP) with torch's DTensor plans, composed with FSDP2 on a 2-D mesh.

A tp group's ranks hold slices of one model and see the *same* share of the mini-batch.
:func:`parallelize` shards after ``config.base_model_tp_plan`` (embedding and lm head over the
vocabulary); every other parameter becomes a ``Replicate()`` DTensor, so clipping, optimizer and
checkpoints see one mesh. Limits: docs/engine.md#tensor-parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from microrl.engine.parallel import tp_layers

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "check_supported",
    "init_mesh",
    "parallelize",
    "wrap",
]

# Attention reshapes with -1 heads and the plan is only colwise/rowwise Linears; each is tested.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
_STYLES = ("colwise", "rowwise")
# Qwen3's per-head q_norm / k_norm: replicated weights on [.., heads / t, head_dim] slices.
_HEAD_SHARDED = "replicated_with_grad_allreduce"
_LAYER_PREFIX = "layers.*."
# Attribute of a parallelized module: its (dp, tp) mesh.
_MESH_ATTR = "_microrl_device_mesh"


def init_mesh(tensor_parallel_size: int, device: torch.device) -> DeviceMesh | None:
    """The ``("dp", "tp")`` mesh (:func:`dp_by_mesh`), or None for ``t == 1``."""
    return dp_by_mesh(tensor_parallel_size, "tensor_parallel_size", "tp", device)


def dp_by_mesh(size: int, key: str, name: str, device: torch.device) -> DeviceMesh | None:
    """The ``("dp", name)`` mesh of ``(world // size, size)`` ranks, consecutive ranks (one node's
    fast interconnect) in one ``name`` group, or None for ``size == 1``; ``ValueError`` naming
    ``key`` for a single process or a size that does not divide the number of processes."""
    if size == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        raise ValueError(
            f"{key}={size} needs {size} processes (or a multiple) under torchrun; this is a "
            "single process"
        )
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"{key}={size} must divide the number of processes ({world})")
    return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("dp", name))


def _base_model(module: nn.Module) -> nn.Module:
    """The transformers base model (embeddings, layers, norm) inside the engine's module."""
    for sub in module.modules():
        if (
            hasattr(sub, "layers")
            and hasattr(sub, "get_input_embeddings")
            and hasattr(sub, "config")
        ):
            return sub
    raise TypeError(f"found no transformers decoder model inside {type(module).__name__}")


def _causal_lm(module: nn.Module) -> nn.Module | None:
    for sub in module.modules():
        get = getattr(sub, "get_output_embeddings", None)
        if callable(get) and isinstance(get(), nn.Linear):
            return sub
    return None


def check_supported(config: Any, tensor_parallel_size: int) -> dict[str, str]:
    """The per-layer TP plan (``{"self_attn.q_proj": "colwise", ...}``) from ``base_model_tp_plan``;
    ``ValueError`` naming an unsupported family or what ``t`` does not divide (heads, MLP width)."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}: model family {family!r} is not "
            f"supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, value in sizes.items():
        if value % tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} must divide the model's {name} "
                f"({value})"
            )
    plan = {}
    for key, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
        if not key.startswith(_LAYER_PREFIX):
            continue  # the embedding (listed for tied models): parallelize() handles it
        if style not in (*_STYLES, _HEAD_SHARDED):
            raise ValueError(
                f"{family}: tensor-parallel plan entry {key!r}: {style!r} is not supported"
            )
        plan[key[len(_LAYER_PREFIX) :]] = style
    if not plan:
        raise ValueError(f"{family}: the model config declares no base_model_tp_plan")
    return plan


def wrap(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """:func:`parallelize` over ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]`` if it has > 1
    rank."""
    from microrl.engine.parallel import distributed

    parallelize(module, mesh)
    if mesh["dp"].size() == 1:
        return module
    return distributed.shard_model(module, mesh=mesh["dp"])


def parallelize(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard the engine's module over ``mesh["tp"]`` in place, from tp rank 0's weights: after LoRA
    and gradient checkpointing, before FSDP2 and the optimizer."""
    tp = mesh["tp"]
    group = tp.get_group()
    configs = (getattr(sub, "config", None) for sub in module.modules())
    plan = check_supported(next((c for c in configs if hasattr(c, "model_type")), None), tp.size())
    base = _base_model(module)
    lm = _causal_lm(module)
    head = lm.get_output_embeddings() if lm is not None else None
    embedding = base.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    head_sharded = set()
    for layer in base.layers:
        for path, style in plan.items():
            if style == _HEAD_SHARDED:
                head_sharded.add(id(layer.get_submodule(path)))
            else:
                _parallelize_linear(layer.get_submodule(path), tp, style)
    if type(embedding) is not nn.Embedding:
        raise ValueError(
            f"tensor parallelism needs an nn.Embedding input embedding, got {type(embedding).__name__}"
        )
    _distribute(embedding, "weight", tp, Shard(0))
    tp_layers.install_vocab_embedding(embedding, group, _vocab_start(embedding.weight, tp))
    if head is not None:
        # Shard(0) over the vocabulary; a call of the module itself gathers the logits.
        if tied:
            head.weight = embedding.weight
        _distribute(head, "weight", tp, Shard(0))
        _distribute(head, "bias", tp, Shard(0))
        tp_layers.install_gathered_head(head, group, _vocab_start(head.weight, tp))
    for sub in module.modules():
        plain = [n for n, p in sub.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        for name in plain:
            _distribute(sub, name, tp, Replicate())
        if plain:
            tp_layers.install_local_params(sub, group, partial_grads=id(sub) in head_sharded)
    setattr(module, _MESH_ATTR, mesh)
    return module


def _distribute(module: nn.Module, name: str, tp: DeviceMesh, placement) -> None:
    """Replace the plain parameter ``module.<name>`` (if any) by a DTensor with ``placement``,
    from tp rank 0's values (a meta one is sliced without communication)."""
    param = module._parameters.get(name)
    if param is None or isinstance(param, DTensor):
        return
    source = None if param.is_meta else 0
    dparam = distribute_tensor(param.detach(), tp, [placement], src_data_rank=source)
    module.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))


def _vocab_start(weight: DTensor, tp: DeviceMesh) -> int:
    """Global row index of this rank's first row of a ``Shard(0)`` DTensor (torch.chunk's split)."""
    rows = weight.shape[0]
    return min(tp.get_local_rank() * -(-rows // tp.size()), rows)


def _lora_parts(layer: nn.Module) -> tuple[nn.Module, list[nn.Linear], list[nn.Linear]]:
    """``(base linear, [lora_A...], [lora_B...])`` of a peft LoRA layer, or ``(layer, [], [])``."""
    base = getattr(layer, "base_layer", None)
    if base is None:
        return layer, [], []
    adapters_a = getattr(layer, "lora_A", {})
    adapters_b = getattr(layer, "lora_B", {})
    dropout = getattr(layer, "lora_dropout", {})
    for name in adapters_a:
        if name in dropout and not isinstance(dropout[name], nn.Identity):
            raise ValueError("tensor_parallel_size > 1 needs lora.dropout = 0")
    return base, list(adapters_a.values()), list(adapters_b.values())


def _parallelize_linear(layer: nn.Module, tp: DeviceMesh, style: str) -> None:
    base, lora_a, lora_b = _lora_parts(layer)
    if type(base) is not nn.Linear:
        raise ValueError(f"tensor parallelism needs nn.Linear layers, got {type(base).__name__}")
    # Column-wise: B gives this rank's output slice; row-wise: A takes its input slice.
    for linear in [base, *(lora_b if style == "colwise" else lora_a)]:
        _shard_linear(linear, tp, style)


def _shard_linear(linear: nn.Linear, tp: DeviceMesh, style: str) -> None:
    group = tp.get_group()
    if style == "colwise":  # weight [out, in] and bias [out] split over the output features
        _distribute(linear, "weight", tp, Shard(0))
        _distribute(linear, "bias", tp, Shard(0))
        tp_layers.install_colwise(linear, group)
    else:  # weight split over the input features, bias added once after the sum
        _distribute(linear, "weight", tp, Shard(1))
        _distribute(linear, "bias", tp, Replicate())
        tp_layers.install_rowwise(linear, group)
