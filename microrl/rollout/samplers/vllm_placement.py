"""Where ``vllm serve`` servers run and how full weights reach them: servers belong to a data
rank, not a process (docs/async.md#vllm-servers, docs/async.md#sequence-parallelism)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from microrl.configs.rollout import parse_gpu_list
from microrl.engine.parallel import distributed
from microrl.rollout.vllm_plugin.transfer import IPC_BACKEND, is_loopback

__all__ = [
    "cuda_visible_devices",
    "data_rank",
    "pushes_per_sync",
    "server_gpus",
    "trainer_address",
    "trainer_gpu",
    "transfer_backend",
    "urls_of_data_rank",
]


def data_rank(engine) -> tuple[int, int]:
    """``(rank, world)`` of this process's data rank (under sp: ``engine.dp_group``'s)."""
    if getattr(engine, "sp_group", None) is not None:
        return dist.get_rank(engine.dp_group), dist.get_world_size(engine.dp_group)
    return distributed.rank(), distributed.world_size()


def urls_of_data_rank(urls: Sequence[str], rank: int, world: int) -> list[str]:
    """Data rank ``rank``'s own servers of ``rollout.server.url`` (every ``world``-th): shared
    ones would mix ranks' pushes, or (vLLM 0.32's CPU LoRA path) probes and samples in a batch."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    mine = [url.strip() for url in urls[rank::world]]
    if not mine:
        raise ValueError(
            f"rollout.server.url lists {len(urls)} servers for {world} data ranks (trainer "
            "processes, or sequence-parallel groups): each needs its own (at least one each)"
        )
    return mine


def pushes_per_sync(engine, urls: Sequence[str], num_workers: int) -> int:
    """The full-weight pushes of one sync on every process: the most servers a data rank has."""
    return -(-len(urls) // data_rank(engine)[1]) if urls else num_workers


def trainer_gpu(device: torch.device) -> int:
    """The ``cuda:N`` index of a CUDA ``device`` (``cuda`` without one: this rank's GPU)."""
    if device.index is not None:
        return device.index
    index = distributed.local_cuda_index()
    return torch.cuda.current_device() if index is None else index


def server_gpus(
    device: torch.device,
    *,
    num_workers: int,
    tensor_parallel_size: int = 1,
    gpus: str = "",
    group_size: int = 1,
) -> list[list[int]] | None:
    """The ``cuda:N`` indices of each of this process's ``num_workers`` local servers
    (``tensor_parallel_size`` each); None on a CPU. Empty ``gpus``: the trainer's GPU; else local
    data rank ``r`` takes the ``r``-th block of the node's dedicated ``gpus``."""
    listed = parse_gpu_list(gpus)
    tp = tensor_parallel_size
    if device.type != "cuda":
        if listed or tp > 1:
            raise ValueError(
                f"rollout.vllm.gpus={gpus!r} and rollout.vllm.tensor_parallel_size={tp} place "
                f"vLLM servers on GPUs, but the trainer runs on {device.type}: leave them unset"
            )
        return None
    own = trainer_gpu(device)
    if not listed:
        if tp > 1:
            raise ValueError(
                f"rollout.vllm.tensor_parallel_size={tp} needs rollout.vllm.gpus: a server "
                "beside its trainer process takes that process's one GPU"
            )
        return [[own] for _ in range(num_workers)]
    count = torch.cuda.device_count()
    unseen = [g for g in listed if g >= count]
    if unseen:
        raise ValueError(
            f"rollout.vllm.gpus={gpus!r} lists GPU {unseen[0]}, but this process sees {count} "
            f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    blocks = max(local_world // group_size, 1)  # the data ranks of this node
    per_rank = num_workers * tp
    if len(listed) < blocks * per_rank:
        who = "trainer process(es)" if group_size == 1 else "sequence-parallel group(s)"
        raise ValueError(
            f"rollout.vllm.gpus={gpus!r} lists {len(listed)} GPUs; {blocks} {who} on this "
            f"node x rollout.num_workers={num_workers} servers x "
            f"rollout.vllm.tensor_parallel_size={tp} need {blocks * per_rank}"
        )
    # This node's trainer processes train on cuda:LOCAL_RANK each, and we on ``own``.
    training = ({own} | set(range(local_world))) if 1 < local_world <= count else {own}
    shared = sorted(set(listed[: blocks * per_rank]) & training)
    if shared:
        raise ValueError(
            f"rollout.vllm.gpus={gpus!r} lists GPU {shared[0]}, which a trainer process of this "
            "node trains on: dedicated sampler GPUs must be others (leave rollout.vllm.gpus "
            "empty to put each server beside its trainer process instead)"
        )
    block = local_rank // group_size
    mine = listed[block * per_rank : (block + 1) * per_rank]
    return [mine[i * tp : (i + 1) * tp] for i in range(num_workers)]


def cuda_visible_devices(indices: Sequence[int]) -> str:
    """A child's ``CUDA_VISIBLE_DEVICES`` for this process's ``cuda:i`` of ``indices``: their
    entries in ours (``"4,5,6,7"`` and ``cuda:1``: ``"5"``), else the indices."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return ",".join(str(i) for i in indices)
    entries = [entry.strip() for entry in parent.split(",") if entry.strip()]
    missing = [i for i in indices if i >= len(entries)]
    if missing:
        raise ValueError(
            f"cuda:{missing[0]} is not in this process's CUDA_VISIBLE_DEVICES={parent!r}"
        )
    return ",".join(entries[i] for i in indices)


def transfer_backend(device: torch.device, gpus: list[list[int]] | None) -> str:
    """The weight-transfer backend for servers on ``gpus`` (None: the user's): ``gloo`` on a CPU,
    :data:`IPC_BACKEND` on the trainer's GPU (NCCL refuses a duplicate GPU), else ``nccl``."""
    if device.type != "cuda":
        return "gloo"
    if gpus is not None and any(trainer_gpu(device) in server for server in gpus):
        return IPC_BACKEND
    return "nccl"


def trainer_address(server_url: str, configured: str = "") -> str:
    """This host's address as ``server_url`` reaches it: ``configured``, loopback, else the
    local address of the route there (a UDP ``connect`` sends nothing)."""
    if configured:
        return configured
    parts = urlsplit(server_url)
    host = parts.hostname
    if not host:
        raise ValueError(f"rollout.server.url: no host in {server_url!r}")
    if is_loopback(host):
        return "127.0.0.1"
    try:
        family, _, _, _, target = socket.getaddrinfo(
            host, parts.port or 80, type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(target)
            return sock.getsockname()[0]
    except OSError as err:
        raise ValueError(
            f"cannot find this host's address on the route to the vLLM server at {server_url} "
            f"({err}); set rollout.vllm.trainer_address to an address of this host it reaches"
        ) from err
