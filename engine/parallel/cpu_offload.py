"""Optimizer and parameter offload (``optim.cpu_offload``): FSDP2's ``CPUOffloadPolicy``.

With the policy, ``fully_shard`` keeps every parameter *shard* in host memory (pinned on CUDA),
copies a unit's shards to the device just before its all-gather, reduce-scatters the gradients on
the device and copies the gradient shards back to host memory; the optimizer, built on the host
parameters, keeps its state there and steps on the CPU. On the device live only the gathered
weights of the units being computed, the activations, and, while a mini-batch's micro-batches
accumulate (gradient sync off until the last one), the unsharded gradients of the units.

What torch does (``torch/distributed/fsdp/_fully_shard``, torch 2.13):

* a model already on the device is sharded there and each shard is then copied to the CPU
  (``_init_sharded_param``); FSDP moves what is not on the mesh's device there first, one unit at
  a time. Buffers (rotary frequencies) stay on the device;
* ``pin_memory`` (on by default) pins the shards and gradients, which needs an accelerator: the
  policy is built with ``pin_memory`` only on CUDA;
* on a CPU mesh (gloo) the copies are no-ops and the code path is the same: parameters and
  optimizer state are host tensors either way, so a CPU run with and without offload computes
  the same numbers (tested on 2 gloo ranks and in one process);
* with NCCL, a collective on host tensors fails ("No backend type associated with device type
  cpu"); torch's ``clip_grad_norm_`` on offloaded ``DTensor`` gradients does exactly that, so the
  engine's clipping reduces the norm on the device instead (``microrl.engine.optim``).

In a single process the engine does not shard (:func:`microrl.engine.parallel.distributed
.init_distributed` starts no group): with ``optim.cpu_offload`` it shards with FSDP2 over one rank
instead, in a process group of one started here (:func:`single_process_group`), and keeps the
single-process semantics everywhere else (no data-parallel group, denominators, metrics).

Under sequence parallelism the policy goes to the same FSDP2 sharding over all ``dp x sp`` ranks
(:func:`microrl.engine.parallel.sequence_parallel.wrap`): the sequence split moves activations
only. Tensor parallelism's weight shards are DTensors of its own, outside FSDP2's policy: the
config refuses ``optim.cpu_offload`` with ``tensor_parallel_size > 1``.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

from microrl.engine.parallel import distributed

__all__ = ["offload_policy", "single_process_group"]


def offload_policy(device: torch.device) -> CPUOffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy`` for the engine's ``device``: pinned host memory on CUDA (the
    copies overlap with compute), plain host memory elsewhere (pinning needs an accelerator)."""
    return CPUOffloadPolicy(pin_memory=torch.device(device).type == "cuda")


def single_process_group(device: torch.device) -> None:
    """Make sure a process group exists for a one-rank FSDP2 mesh in this single process.

    A group the caller initialised (of one rank) is used as is. Otherwise a group of one rank is
    started on an in-memory store (gloo for host tensors, NCCL too on CUDA) and ended at
    interpreter exit. It has one rank, so the rest of microrl still sees a single process
    (``distributed.is_distributed()`` is False, no data-parallel group).

    Raises:
        ValueError: when an initialised group has more than one rank (the engine would then be
            data-parallel, not here).
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(
                f"a process group of {dist.get_world_size()} ranks exists: the engine shards "
                "over it (data parallelism), not over a single rank"
            )
        return
    backend = "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(distributed.shutdown)
