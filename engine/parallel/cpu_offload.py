"""Optimizer and parameter offload (``optim.cpu_offload``): FSDP2's ``CPUOffloadPolicy``.

Full fine-tunes whose parameters, gradients and optimizer state do not fit the GPUs keep them in
host memory. With the policy, ``fully_shard`` keeps every parameter *shard* on the host and copies
a unit's shards to the device before its all-gather; the optimizer steps on the CPU. In a single
process the engine does not shard, so with ``optim.cpu_offload`` it shards over one rank instead,
in a process group of one started here (:func:`single_process_group`). What torch does, the cost,
and the limits (sequence parallelism composes; tensor parallelism is refused) are in
docs/distributed.md, "Optimizer and parameter offload".
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
