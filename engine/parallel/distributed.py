"""Data parallelism with FSDP2: process-group setup, sharding, gradient sync, empty shares.

Launch with ``torchrun``; each rank passes its own share of the mini-batch. Without a process
group every helper is a no-op. FSDP's collectives run per forward and backward, so every rank
runs the same number of micro-batches (:func:`agree_num_micro_batches`, :func:`placeholder_row`).
Contract: docs/engine.md#distributed.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

__all__ = [
    "agree_num_micro_batches",
    "all_reduce",
    "barrier",
    "collective_device",
    "default_backend",
    "default_mp_policy",
    "dp_group",
    "find_shard_units",
    "finish_sharding",
    "gathered",
    "init_distributed",
    "is_distributed",
    "is_empty_batch",
    "local_cuda_index",
    "max_over_ranks",
    "placeholder_row",
    "rank",
    "set_gradient_sync",
    "shard_model",
    "shutdown",
    "world_size",
]

# Decoder-block containers, for a model without ``_no_split_modules``.
_LAYER_CONTAINER_NAMES = ("layers", "h", "blocks", "layer")

# Attribute of a module sharded by shard_model: its units' reshard_after_forward setting.
_RESHARD_ATTR = "_microrl_reshard_after_forward"

# NCCL's default 10 min is too short for a first compile or a slow filesystem; gloo uses it too.
_DEFAULT_TIMEOUT = timedelta(minutes=30)

# The exit barrier of the last shutdown(), kept referenced until the interpreter is torn down.
_exit_barrier: dist.Work | None = None


def is_distributed() -> bool:
    """Whether torch.distributed is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's global rank (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank; a no-op in a single process."""
    if is_distributed():
        dist.barrier()


def dp_group() -> dist.ProcessGroup | None:
    """The data-parallel group (the default group), or ``None`` in a single process."""
    return dist.group.WORLD if is_distributed() else None


def local_cuda_index() -> int | None:
    """The GPU this rank owns: ``LOCAL_RANK`` under torchrun, the one visible GPU (a launcher that
    gives each rank its own), else the current GPU; None without CUDA. ``ValueError`` when torchrun
    starts more processes on a node than it has visible GPUs (they would share GPU 0)."""
    if not torch.cuda.is_available():
        return None
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return torch.cuda.current_device()
    count = torch.cuda.device_count()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", int(local) + 1))
    if count == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return 0  # each rank sees its own GPU; NCCL refuses two ranks on one ("Duplicate GPU")
    if per_node > count:
        raise ValueError(
            f"torchrun started {per_node} processes on this node (--nproc_per_node) but only "
            f"{count} GPU{'s are' if count > 1 else ' is'} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
            "start at most one process per GPU"
        )
    return int(local)


def init_distributed(
    backend: str | None = None, *, timeout: timedelta = _DEFAULT_TIMEOUT
) -> dist.ProcessGroup | None:
    """Return the DP process group: the initialised one, or one started from torchrun's environment.

    On CUDA the rank first takes its own GPU (:func:`local_cuda_index`), also for a caller's
    group: NCCL would otherwise put every rank on GPU 0. Under ``torchrun`` (``WORLD_SIZE`` > 1)
    the default group is torn down at exit (:func:`shutdown`); otherwise returns ``None``.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if not dist.is_available():
        return None
    cuda_index = local_cuda_index()
    if cuda_index is not None:
        torch.cuda.set_device(cuda_index)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        dist.init_process_group(backend or default_backend(cuda_index), timeout=timeout)
        # End it at exit while the interpreter is alive (shutdown keeps gloo's threads off the GIL).
        atexit.register(shutdown)
    return dp_group()


def default_backend(cuda_index: int | None) -> str:
    """``"cpu:gloo,cuda:nccl"`` on GPUs (host tensors reduce too), ``"gloo"`` on CPUs."""
    return "gloo" if cuda_index is None else "cpu:gloo,cuda:nccl"


def collective_device(device: torch.device | str, group: dist.ProcessGroup | None = None):
    """Where a collective on ``group`` takes a tensor on ``device``: there if the group has a
    backend for it, else this rank's GPU (a caller's NCCL-only group)."""
    device = torch.device(device)
    if not (dist.is_available() and dist.is_initialized()):
        return device
    backends = dist.BackendConfig(dist.get_backend(group)).get_device_backend_map()
    if device.type in backends or not torch.cuda.is_available():
        return device
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``tensor`` reduced over ``group`` (itself without one), returned on ``tensor``'s device."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    device = collective_device(tensor.device, group)
    buffer = tensor.to(device)
    dist.all_reduce(buffer, op=op, group=group)
    return buffer.to(tensor.device)


def shutdown() -> None:
    """Wait for every rank, then destroy the default group (registered at exit; a no-op without
    one). Skipped after an uncaught exception: the peers may be in a collective a barrier would pair
    with."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if getattr(sys, "last_value", None) is not None:  # set when an uncaught exception was printed
        return
    global _exit_barrier
    if is_distributed():
        # Kept: a gloo thread freeing the last reference at exit needs the GIL (std::terminate).
        _exit_barrier = dist.barrier(async_op=True)
        _exit_barrier.wait()
    dist.destroy_process_group()


def default_mp_policy(device_type: str) -> MixedPrecisionPolicy | None:
    """bf16 compute, fp32 reduction on CUDA; ``None`` (fp32) elsewhere (CPU bf16 is slow)."""
    if device_type == "cuda":
        # cast_forward_inputs=False: the root's float inputs (a temperature) must keep fp32.
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return None


def find_shard_units(module: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a transformers model (also under PEFT or a wrapper), in order: from
    ``_no_split_modules``, else a ``ModuleList`` named like ``layers``; nested units dropped."""
    names: set[str] = set()
    for sub in module.modules():
        declared = getattr(type(sub), "_no_split_modules", None) or getattr(
            sub, "_no_split_modules", None
        )
        if isinstance(declared, list | tuple | set):
            names.update(str(n) for n in declared)
    units: list[nn.Module] = []
    if names:
        units = [m for m in module.modules() if type(m).__name__ in names]
    if not units:
        for name, sub in module.named_modules():
            if isinstance(sub, nn.ModuleList) and name.rsplit(".", 1)[-1] in _LAYER_CONTAINER_NAMES:
                units.extend(sub)
    inner: set[int] = set()
    for unit in units:
        for sub in unit.modules():
            if sub is not unit:
                inner.add(id(sub))
    return [u for u in units if id(u) not in inner]


def _untied_input_embeddings(module: nn.Module) -> list[nn.Module]:
    """Untied input embeddings inside ``module`` (a tied one stays in the root with the head)."""
    uses: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    found: list[nn.Module] = []
    for sub in module.modules():
        if not hasattr(sub, "_no_split_modules") or not hasattr(sub, "get_input_embeddings"):
            continue
        try:
            embedding = sub.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            continue
        if not isinstance(embedding, nn.Embedding) or any(embedding is f for f in found):
            continue
        if uses.get(id(embedding.weight), 0) == 1:
            found.append(embedding)
    return found


def shard_model(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | Literal["auto"] | None = "auto",
    reshard_after_forward: bool = True,
    offload_policy: OffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``module`` with FSDP2 over ``mesh``: each decoder layer a unit, then the root.

    An untied input embedding is a unit of its own; the final norm, lm head and a value head belong
    to the root, gathered from its forward to the end of the backward (the fused kernel reads the
    full head weight once per micro-batch). Call it after LoRA and gradient checkpointing and
    *before* building the optimizer. ``module`` is the module the engine calls; its outputs that
    require a gradient are returned as copies (FSDP2 could lose its pre-backward hook on a view).
    ``mp_policy="auto"``: :func:`default_mp_policy`; ``offload_policy``: for ``optim.cpu_offload``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError("module is already sharded with FSDP2 (shard_model called twice?)")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard_model needs an initialised process group (see init_distributed)")
    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    if mesh.ndim != 1:
        raise ValueError(f"mesh must be a 1-D data-parallel mesh, got {mesh.ndim} dimensions")
    policy = default_mp_policy(mesh.device_type) if mp_policy == "auto" else mp_policy
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    if policy is not None:
        kwargs["mp_policy"] = policy
    units = find_shard_units(module)
    if not units:
        raise ValueError(
            f"found no decoder layers to shard in {type(module).__name__} (no _no_split_modules "
            "and no ModuleList named 'layers'); pass a transformers model or its wrapper"
        )
    on_meta = any(p.is_meta for p in module.parameters())  # rank-0 loading fills it afterwards
    if not on_meta:
        broadcast_from_rank0(module, group=mesh.get_group())
    for unit in units:
        fully_shard(unit, **kwargs)
    for embedding in _untied_input_embeddings(module):
        # Its own unit, gathered only for the lookup: often the model's largest matrix.
        fully_shard(embedding, **kwargs)
    # The root stays gathered forward to backward; explicit, as torch 2.13 honours True there too.
    fully_shard(module, **{**kwargs, "reshard_after_forward": False})
    # Before FSDP's post-forward hook (prepend): it hooks the pre-backward all-gather on outputs.
    module.register_forward_hook(_copy_grad_outputs, prepend=True)
    setattr(module, _RESHARD_ATTR, reshard_after_forward)
    if not on_meta:
        _init_root_state(module)
    return module


def finish_sharding(module: nn.Module) -> None:
    """Make a meta-device module sharded by :func:`shard_model` the FSDP root, once filled."""
    if isinstance(module, FSDPModule):
        _init_root_state(module)


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, *, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank 0's parameters and buffers to every rank, in place, before sharding: FSDP2 keeps
    each rank's own shard, so different random inits would train a silent mixture."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*module.parameters(), *module.buffers()]:
        # A tensor-parallel DTensor: its local slice, from the dp rank 0 of the same tp slice.
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor.data
        dist.broadcast(local, src=src, group=group)


@torch.no_grad()
def _init_root_state(module: FSDPModule) -> None:
    """Make ``module`` the FSDP root now: a call bypassing the root first (``generate`` in
    :func:`gathered`) would make a decoder layer the root and training fail ("FSDP requires running
    forward through the root module first"). A collective no-op forward, then a reshard."""
    own = module.__dict__.get("forward")  # an instance-level forward is put back as it was
    module.forward = _no_forward
    try:
        module()
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
    module.reshard()


def _no_forward(*args: object, **kwargs: object) -> None:
    return None


def _copy_grad_outputs(module: nn.Module, args: object, output: object) -> object:
    """Forward hook of the sharded root, before FSDP's: outputs that need a gradient are copied, as
    FSDP puts its pre-backward hook on them and an in-place op on a view (the heads' outputs) would
    drop it; one ``[b, L]`` tensor per output. Inference is left alone."""
    if not torch.is_grad_enabled():
        return None
    return _copy_grad_tensors(output)


def _copy_grad_tensors(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.clone() if value.requires_grad else value
    if type(value) in (tuple, list):
        return type(value)(_copy_grad_tensors(v) for v in value)
    if type(value) is dict:
        return {key: _copy_grad_tensors(v) for key, v in value.items()}
    return value


@contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Inside the block every parameter of a sharded ``module`` is the full tensor, each unit
    gathered once (for ``engine.model.generate``). Collective: every rank enters it and runs the
    same number of forwards. A no-op for an unsharded module."""
    if not isinstance(module, FSDPModule):
        yield
        return
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        if unit is not module:
            unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        reshard = getattr(module, _RESHARD_ATTR, True)
        for unit in units:
            unit.reshard()
            if unit is not module:
                unit.set_reshard_after_forward(reshard, recurse=False)


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn FSDP2's gradient reduce-scatter on (last micro-batch) or off (the ones before it, which
    accumulate full-size gradients locally). A no-op for an unsharded module."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)


def agree_num_micro_batches(num_micro_batches: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest local micro-batch count over the ranks (the others run empty ones)."""
    if not isinstance(num_micro_batches, int) or num_micro_batches < 0:
        raise ValueError(f"num_micro_batches must be an int >= 0, got {num_micro_batches!r}")
    return max_over_ranks(num_micro_batches, group)


def max_over_ranks(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest ``value`` over the ranks of ``group`` (``value`` itself without a group)."""
    count = torch.tensor([value], dtype=torch.int64)
    return int(all_reduce(count, dist.ReduceOp.MAX, group).item())


def is_empty_batch(batch: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``batch`` (a TensorDict or a mapping of ``[B, T]`` tensors) has no row."""
    ids = batch.get("input_ids", None)
    return isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 0


def placeholder_row(batch: Mapping[str, torch.Tensor]) -> TensorDict:
    """One row ``[1, T]`` standing in for a rank's empty share ``[0, T]``, so it runs the FSDP
    collectives of the ranks with data: one real token (id 0) and no loss; every key a zero row of
    its dtype (a temperature 1)."""
    columns = batch["input_ids"].shape[1]
    if columns == 0:
        raise ValueError("input_ids must have at least one column (T >= 1), got [0, 0]")
    rows = {key: value.new_zeros((1, *value.shape[1:])) for key, value in batch.items()}
    if "temperature" in rows:  # per-row/per-token sampling temperature: must stay > 0
        rows["temperature"] = torch.ones_like(rows["temperature"])
    attention = torch.zeros(1, columns, dtype=torch.bool, device=batch["input_ids"].device)
    attention[0, 0] = True
    rows["attention_mask"] = attention.to(
        batch["attention_mask"].dtype if "attention_mask" in batch else torch.bool
    )
    rows.pop("position_ids", None)  # derived from the mask
    return TensorDict(rows, batch_size=[1])
