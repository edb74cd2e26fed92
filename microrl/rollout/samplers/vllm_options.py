"""vLLM's options: the rules the in-process engine and the local servers share.

Both integrations start the same vLLM engine, one as ``vllm.LLM(**kwargs)`` (the colocated
``vllm`` backend) and one as ``vllm serve --flags`` (:mod:`microrl.rollout`), and sample from it
the same way, so every rule they both apply is here, once (docs/rollouts.md#vllm-engine-arguments):

- the engine: :func:`resolve_dtype` (``dtype=auto``), :func:`adapter_dtype` (what a LoRA sync
  writes), :func:`kv_cache_mb` (the CPU KV cache),
  :func:`enforce_eager`, :func:`engine_seed`, :func:`max_lora_rank`, :func:`cpu_scheduler_args`;
- ``rollout.vllm.engine_kwargs``: :func:`user_engine_args`, refused where a key is one microrl
  must own (:data:`OWNED`, :data:`TYPED_KEYS`), and :func:`cli_flags` for ``vllm serve``;
- sampling: :func:`sampling_args` (vLLM's ``SamplingParams`` fields) and
  :func:`requests_per_prompt` (greedy copies), seeded from
  :func:`~microrl.rollout.base.draw_seed`;
- the exports vLLM reads: :func:`make_workdir` and :func:`remove_workdir`;
- :func:`placement`: the executor and environment that start the in-process engine on the
  engine's GPU.

Importable without vLLM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from microrl.engine.parallel import distributed
from microrl.engine.parallel.nodes import shared_tempdir
from microrl.rollout import watcher
from microrl.rollout.base import SEED_RANGE

if TYPE_CHECKING:
    from microrl.configs.rollout import VLLMConfig
    from microrl.rollout.base import SamplingParams

__all__ = [
    "CPU_KV_CACHE_MB",
    "CPU_OWNED",
    "IN_PROCESS_OWNED",
    "OWNED",
    "SERVER_OWNED",
    "TYPED_KEYS",
    "VLLM_LORA_RANKS",
    "adapter_dtype",
    "cli_flags",
    "cpu_scheduler_args",
    "enforce_eager",
    "engine_seed",
    "environ",
    "gpu_index",
    "kv_cache_mb",
    "make_workdir",
    "max_lora_rank",
    "placement",
    "remove_workdir",
    "requests_per_prompt",
    "resolve_dtype",
    "sampling_args",
    "user_engine_args",
]

#: vLLM's KV cache on a CPU, in MiB, when ``rollout.vllm.kv_cache_memory_mb`` leaves it to us.
CPU_KV_CACHE_MB = 256
#: The LoRA ranks vLLM supports (``max_lora_rank``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: Engine arguments microrl sets itself in both integrations, and why a user value cannot win.
OWNED: dict[str, str] = {
    "model": "vLLM serves microrl's own export of the trained model",
    "skip_tokenizer_init": "microrl sends and reads token ids, never text",
    "logprobs_mode": "the loss scores the log-probs of the sampling distribution "
    "(processed_logprobs)",
    "generation_config": "sampling follows microrl's SamplingParams only, not the model's "
    "generation_config.json",
    "enable_lora": "set from the engine: adapters for a LoRA engine, full weights otherwise",
    "enable_sleep_mode": "set from rollout.vllm.sleep_level",
}
#: Owned by the in-process engine only: its weights are synced as tensors in this process.
IN_PROCESS_OWNED: dict[str, str] = {
    "distributed_executor_backend": "the in-process engine runs in the trainer's process "
    "(external_launcher under torchrun or on cuda:N, else uni)",
}
#: Owned by the local servers only.
SERVER_OWNED: dict[str, str] = {
    "host": "local servers listen on 127.0.0.1 only",
    "port": "microrl picks a free port",
    "api_key": "microrl makes a fresh key per server (VLLM_API_KEY)",
    "enable_scale_out": "microrl samples through /inference/v1/generate",
    "weight_transfer_config": "full weights are pushed over microrl's chosen transfer backend",
}
#: Owned on a CPU: a prompt split across scheduler steps (chunked prefill) crashes vLLM's CPU
#: sampler on a seeded request (docs/rollouts.md#long-prompts-on-a-cpu).
CPU_OWNED: dict[str, str] = {
    key: "vLLM's CPU build cannot sample a seeded prompt that is split across scheduler steps, "
    "so microrl turns chunked prefill off on a CPU"
    for key in ("enable_chunked_prefill", "long_prefill_token_threshold")
}
#: Engine arguments that have their own ``rollout.vllm`` key: set there, not twice.
TYPED_KEYS: dict[str, str] = {
    "dtype": "dtype",
    "seed": "seed",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enforce_eager": "enforce_eager",
    "max_model_len": "max_model_len",
    "kv_cache_memory_bytes": "kv_cache_memory_mb",
}
_KEY = "rollout.vllm.engine_kwargs"
# The temporary directories a start sweeps when their owner died (only those it marked).
_SWEPT_PREFIX = "microrl-"
logger = logging.getLogger(__name__)


def resolve_dtype(requested: str, engine, base) -> str:
    """vLLM's compute dtype: ``requested`` unless it is ``auto``; ``auto`` is what the trainer
    computes in: ``bfloat16`` on CUDA, where the engine autocasts to bf16 (``actor.dtype`` auto
    or bfloat16), else the storage dtype of ``base``'s weights (float32 on a CPU). A float32
    vLLM on a GPU would hold twice the weights of its memory share (30.5 GB for a 7B)."""
    if requested != "auto":
        return requested
    if engine.device.type == "cuda" and engine.config.dtype in ("auto", "bfloat16"):
        return "bfloat16"
    return str(next(base.parameters()).dtype).removeprefix("torch.")


def adapter_dtype(served: str, engine_kwargs: Mapping[str, Any]) -> torch.dtype:
    """The dtype vLLM holds a LoRA adapter in: ``rollout.vllm.engine_kwargs.lora_dtype`` when
    set, else the dtype it serves (``served``, :func:`resolve_dtype`). vLLM casts an adapter to
    it as it loads it, so an adapter written in it loads into the same tensors as one written in
    float32, from fewer bytes (half for bfloat16): what a LoRA sync writes."""
    args = {str(key).replace("-", "_"): value for key, value in engine_kwargs.items()}
    requested = args.get("lora_dtype", "auto")
    if isinstance(requested, torch.dtype):
        return requested
    name = served if requested in (None, "auto") else str(requested).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"rollout.vllm.engine_kwargs.lora_dtype must be auto, float16 or bfloat16, got "
            f"{requested!r}"
        )
    return dtype


def kv_cache_mb(config: VLLMConfig, device: torch.device) -> int:
    """vLLM's KV cache in MiB: ``rollout.vllm.kv_cache_memory_mb``, else
    :data:`CPU_KV_CACHE_MB` on a CPU, else 0 (vLLM sizes it from ``gpu_memory_utilization``).
    On a CPU vLLM would reserve that fraction of the machine's memory, and fail when the
    trainer already holds it."""
    return config.kv_cache_memory_mb or (CPU_KV_CACHE_MB if device.type == "cpu" else 0)


def enforce_eager(config: VLLMConfig, device: torch.device) -> bool:
    """Whether vLLM runs without CUDA graphs: ``rollout.vllm.enforce_eager``, else on a CPU
    only (a CPU has no CUDA graphs to capture)."""
    return device.type == "cpu" if config.enforce_eager is None else config.enforce_eager


def engine_seed(seed: int, *, rank: int, index: int = 0, per_rank: int = 1) -> int:
    """The seed of the ``index``-th of the ``per_rank`` vLLM engines of trainer ``rank``:
    ``rollout.vllm.seed`` plus the engine's place among all of the run's engines, so no two
    engines of a run share a seed."""
    return seed + rank * per_rank + index


def max_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest rank vLLM supports
    that holds it.

    Raises:
        ValueError: ``rank`` is above vLLM's largest (512), naming ``lora.rank``.
    """
    for supported in VLLM_LORA_RANKS:
        if rank <= supported:
            return supported
    raise ValueError(f"lora.rank={rank} is larger than vLLM supports ({VLLM_LORA_RANKS[-1]})")


def requests_per_prompt(params: SamplingParams) -> int:
    """vLLM requests per prompt: one for all ``params.num_samples`` samples, or, greedy, one
    per sample (vLLM refuses ``n > 1`` without randomness: the copies are separate requests)."""
    return params.num_samples if params.greedy else 1


def sampling_args(
    params: SamplingParams, *, seed: int, eos_token_id: int | Sequence[int]
) -> dict[str, Any]:
    """The fields of vLLM's ``SamplingParams`` for one request of ``params``
    (:func:`requests_per_prompt` requests per prompt): its samples, greedy as temperature 0,
    top-k off as -1, the sampled token's log-prob only, stopped at ``eos_token_id`` (one id or
    the backend's ``stop_token_ids``: vLLM runs without a tokenizer, ids in, ids out), ``seed``
    wrapped into vLLM's int32 range."""
    return {
        "n": 1 if params.greedy else params.num_samples,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "logprobs": 0,
        "stop_token_ids": [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
        "seed": seed % SEED_RANGE,
        "detokenize": False,
    }


def make_workdir(workdir: str | None, prefix: str) -> tuple[Path, bool]:
    """Where the exports vLLM reads (the base model, adapters) are written, and whether it is
    ours to remove: ``workdir``, else a fresh temporary directory, rank 0's on every rank,
    checked visible on every node (:func:`~microrl.engine.parallel.nodes.shared_tempdir`:
    rank 0 writes the exports every rank's engine reads). Collective without ``workdir``.

    A temporary one is removed by rank 0's watcher if rank 0 dies before
    :func:`remove_workdir` (:mod:`~microrl.rollout.watcher`); the ones of killed runs
    whose watcher died too are swept first."""
    if workdir:
        return Path(workdir), False
    if distributed.rank() == 0:
        for path in watcher.sweep_stale_dirs(_SWEPT_PREFIX):
            logger.warning("removed %s, left by a microrl process that was killed", path)
    path = Path(shared_tempdir(prefix))
    if distributed.rank() == 0:
        watcher.mark_owner(path)
        watcher.watch("directory", path, label=f"its temporary model directory {path}")
    return path, True


def remove_workdir(workdir: Path, *, owned: bool) -> None:
    """Remove ``workdir`` (rank 0, which made it) when :func:`make_workdir` made it."""
    if owned and distributed.rank() == 0:
        shutil.rmtree(workdir, ignore_errors=True)
        watcher.release("directory", workdir)


def cpu_scheduler_args() -> dict[str, Any]:
    """The scheduler arguments of vLLM on a CPU: no chunked prefill.

    vLLM 0.32 splits a step's prompts at its token budget (``max_num_batched_tokens``, 2048 for
    ``vllm serve`` and 4096 for ``vllm.LLM`` on a CPU) and, for a request whose prompt is only
    partly computed, rewinds its seeded generator (``gpu_model_runner._bookkeeping_sync``:
    ``gen.set_offset``), which a CPU generator refuses (``CPU Generator does not use offset``).
    Without chunked prefill a prompt is scheduled whole or waits for the next step, and vLLM
    raises its budget to at least ``max_model_len``, so every prompt fits in one step; the
    requests keep their seeds, so seeded sampling stays reproducible."""
    return {"enable_chunked_prefill": False}


def user_engine_args(
    engine_kwargs: Mapping[str, Any], *, owned: Mapping[str, str], valid: Iterable[str] = ()
) -> dict[str, Any]:
    """``rollout.vllm.engine_kwargs`` with dashes in names made underscores, checked.

    Raises:
        ValueError: naming ``rollout.vllm.engine_kwargs.<key>``: a key in ``owned`` (and why
            microrl owns it), one with its own ``rollout.vllm`` key (:data:`TYPED_KEYS`), or,
            when ``valid`` names vLLM's arguments, one that is not among them.
    """
    valid = set(valid)
    args = {}
    for name, value in engine_kwargs.items():
        key = str(name).replace("-", "_")
        if key in owned:
            raise ValueError(f"{_KEY}.{key} cannot be set: microrl owns it ({owned[key]})")
        if key in TYPED_KEYS:
            raise ValueError(
                f"{_KEY}.{key} cannot be set: use rollout.vllm.{TYPED_KEYS[key]} instead"
            )
        if valid and key not in valid:
            raise ValueError(
                f"{_KEY}.{key} is not an argument of vllm.LLM (vLLM's EngineArgs); see "
                "`vllm serve --help` for the engine arguments"
            )
        args[key] = value
    return args


def cli_flags(kwargs: Mapping[str, Any]) -> list[str]:
    """``vllm serve`` flags of keyword arguments: ``max_num_seqs=64`` -> ``--max-num-seqs 64``;
    a bool is ``--flag`` or ``--no-flag``, a list its items after the flag, a dict its JSON
    (vLLM parses JSON for its config-valued arguments), None leaves vLLM's default."""
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            flags += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def placement(device: torch.device) -> tuple[dict, dict[str, str]]:
    """vLLM's executor and the environment it starts in, so that it runs on ``device``.

    vLLM's in-process executor (``uni``) takes GPU 0 whatever the current device; its
    ``external_launcher`` takes GPU ``LOCAL_RANK``. Under ``torchrun`` (the trainer's group
    exists) every rank uses the launcher with ``LOCAL_RANK`` set to its engine's GPU; one
    process on ``cuda:N``, N > 0, does too, as a group of one (``RANK=0``, ``WORLD_SIZE=1``
    and a free local port, only while vLLM starts)."""
    on_gpu = device.type == "cuda"
    index = gpu_index(device) if on_gpu else 0
    env = {"LOCAL_RANK": str(index)} if on_gpu else {}
    if distributed.is_distributed():
        return {"distributed_executor_backend": "external_launcher"}, env
    if on_gpu and index != 0:
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        return {"distributed_executor_backend": "external_launcher"}, env
    return {}, {}


def free_port() -> int:
    """A TCP port free on the loopback address now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gpu_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (the current one for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def environ(env: dict[str, str]):
    """``env`` set in ``os.environ`` for the block, the previous values put back after it."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
