"""Where ``vllm serve`` servers run and how full weights reach them (docs/async.md#vllm-servers).

* :func:`server_gpus`: the GPUs of each local server, in this process's ``cuda:N`` numbering:
  the trainer process's own GPU (colocated, the default), or this process's share of a
  dedicated list (``rollout.vllm.gpus``), ``tensor_parallel_size`` GPUs per server.
  :func:`cuda_visible_devices` turns them into the server's ``CUDA_VISIBLE_DEVICES`` through the
  trainer's own mapping, so a server never lands on GPU 0 by default.
* :func:`transfer_backend`: vLLM's weight-transfer engine for a full fine-tune: ``gloo`` on a
  CPU, microrl's CUDA-IPC engine for a server on the trainer's own GPU (NCCL refuses two ranks
  of one communicator on one GPU: "Duplicate GPU detected"), ``nccl`` otherwise.
* :func:`trainer_address`: the address a server's workers reach the trainer's rendezvous at.
* :func:`data_rank` and :func:`urls_of_data_rank`: servers belong to a data rank, not a process
  (a sequence-parallel group shares one set, docs/async.md#sequence-parallelism).
"""

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
    "IPC_BACKEND",
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
    """``(rank, world)`` of this process's data rank: under sequence parallelism its sp group's
    index among the groups (the rank in ``engine.dp_group``, one process of each group); else
    this process's rank among all (``(0, 1)`` in one process)."""
    if getattr(engine, "sp_group", None) is not None:
        return dist.get_rank(engine.dp_group), dist.get_world_size(engine.dp_group)
    return distributed.rank(), distributed.world_size()


def urls_of_data_rank(urls: Sequence[str], rank: int, world: int) -> list[str]:
    """The servers of ``rollout.server.url`` that data rank ``rank`` of ``world`` samples on:
    every ``world``-th one from the ``rank``-th, so each data rank has its own (a full
    fine-tune's pushes would overwrite each other's, and vLLM 0.32's CPU LoRA path fails a batch
    mixing one rank's probe with another's samples). ``ValueError`` when there are fewer servers
    than data ranks."""
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
    """The full-weight pushes of one sync on every process: the most servers a data rank has
    (``num_workers`` local ones, or its share of ``urls``); one with fewer joins the others'
    gathers."""
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
    """The ``cuda:N`` indices of each of this trainer process's ``num_workers`` local servers
    (``tensor_parallel_size`` each), or None when the trainer runs on a CPU.

    Empty ``gpus``: every server on the trainer's own GPU (``device``). Else ``gpus`` lists GPUs
    dedicated to the servers of this node: local data rank ``r`` (local rank // ``group_size``,
    the processes of a sequence-parallel group, consecutive, sharing one server set) takes the
    ``r``-th block of ``num_workers * tensor_parallel_size`` GPUs, server ``i`` the ``i``-th
    ``tensor_parallel_size`` of its block. Raises ``ValueError`` naming the keys: GPUs on a CPU, TP beside the trainer,
    too few GPUs, one this process cannot see, or one a trainer process of this node trains on.
    """
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
    local_rank, local_world = _local_rank_and_world()
    blocks = max(local_world // group_size, 1)  # the data ranks of this node
    per_rank = num_workers * tp
    if len(listed) < blocks * per_rank:
        who = "trainer process(es)" if group_size == 1 else "sequence-parallel group(s)"
        raise ValueError(
            f"rollout.vllm.gpus={gpus!r} lists {len(listed)} GPUs; {blocks} {who} on this "
            f"node x rollout.num_workers={num_workers} servers x "
            f"rollout.vllm.tensor_parallel_size={tp} need {blocks * per_rank}"
        )
    training = _training_gpus(own, local_world, count)
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
    """``CUDA_VISIBLE_DEVICES`` for a child process that must use this process's ``cuda:i``
    for each ``i`` of ``indices``: their entries in this process's own ``CUDA_VISIBLE_DEVICES``
    (``"4,5,6,7"`` and ``cuda:1``: ``"5"``), the indices themselves when it is unset."""
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
    """The weight-transfer backend of a full fine-tune's servers placed on ``gpus``
    (:func:`server_gpus`; None: servers the user started, on other GPUs or nodes): ``gloo``
    for a CPU trainer, :data:`IPC_BACKEND` when a server shares the trainer's GPU, else
    ``nccl``."""
    if device.type != "cuda":
        return "gloo"
    own = trainer_gpu(device)
    if gpus is not None and any(own in server for server in gpus):
        return IPC_BACKEND
    return "nccl"


def trainer_address(server_url: str, configured: str = "") -> str:
    """The address of this host as the server at ``server_url`` reaches it: ``configured``
    (``rollout.vllm.trainer_address``) when set; ``127.0.0.1`` for a server on this host's
    loopback; else the local address of the route to the server's host (a UDP ``connect``,
    which only picks the route: it sends nothing)."""
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


def _local_rank_and_world() -> tuple[int, int]:
    """This process's rank among the trainer processes of its node, and their number
    (torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; 0 and 1 outside it)."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def _training_gpus(own: int, local_world: int, count: int) -> set[int]:
    """The GPUs this node's trainer processes train on: ``cuda:LOCAL_RANK`` each under torchrun
    when this process sees that many (:func:`~microrl.engine.parallel.distributed.local_cuda_index`),
    and this process's own."""
    return ({own} | set(range(local_world))) if 1 < local_world <= count else {own}
