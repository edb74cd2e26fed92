"""Optimizer and parameter offload (``optim.cpu_offload``): FSDP2's ``CPUOffloadPolicy``.

Parameter shards live on the host and the optimizer steps on the CPU; a single process shards
over one rank (:func:`single_process_group`). Costs and limits:
docs/distributed.md#optimizer-and-parameter-offload.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

from microrl.engine.parallel import distributed

__all__ = ["offload_policy", "single_process_group"]


def offload_policy(device: torch.device) -> CPUOffloadPolicy:
    """FSDP2's ``CPUOffloadPolicy``: pinned host memory on CUDA (copies overlap compute)."""
    return CPUOffloadPolicy(pin_memory=torch.device(device).type == "cuda")


def single_process_group(device: torch.device) -> None:
    """Make sure a process group exists for a one-rank FSDP2 mesh in this single process: a caller's
    one-rank group as is, else one on an in-memory store, ended at exit (the rest of microrl still
    sees a single process); ``ValueError`` for an initialised group of more than one rank."""
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
