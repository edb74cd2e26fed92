"""vLLM's options the in-process ``vllm.LLM`` and the ``vllm serve`` servers share; no vLLM import
(docs/rollouts.md#vllm-engine-arguments)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from microrl.engine.checkpoint.export import export_merged_model
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
    "config_options",
    "enforce_eager",
    "engine_args",
    "engine_seed",
    "export_base",
    "kv_cache_mb",
    "make_workdir",
    "max_lora_rank",
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

#: Engine arguments microrl sets in both integrations, and why a user value cannot win.
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
#: Owned on a CPU (:func:`engine_args`, docs/rollouts.md#long-prompts-on-a-cpu).
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
# Temporary directories swept when their (marked) owner died.
_SWEPT_PREFIX = "microrl-"
logger = logging.getLogger(__name__)


def resolve_dtype(requested: str, engine, base) -> str:
    """vLLM's compute dtype: ``requested``, or for ``auto`` the trainer's: ``bfloat16`` on CUDA
    under bf16 autocast (a float32 vLLM would hold twice the weights), else ``base``'s storage."""
    if requested != "auto":
        return requested
    if engine.device.type == "cuda" and engine.config.dtype in ("auto", "bfloat16"):
        return "bfloat16"
    return str(next(base.parameters()).dtype).removeprefix("torch.")


def adapter_dtype(served: str, engine_kwargs: Mapping[str, Any]) -> torch.dtype:
    """The dtype a LoRA sync writes: vLLM's (``engine_kwargs.lora_dtype``, else ``served``)."""
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
    """vLLM's KV cache in MiB: ``rollout.vllm.kv_cache_memory_mb``, else :data:`CPU_KV_CACHE_MB`
    on a CPU (a fraction of the machine's memory would clash with the trainer's), else 0."""
    return config.kv_cache_memory_mb or (CPU_KV_CACHE_MB if device.type == "cpu" else 0)


def enforce_eager(config: VLLMConfig, device: torch.device) -> bool:
    """Whether vLLM runs without CUDA graphs: ``rollout.vllm.enforce_eager``, else on a CPU."""
    return device.type == "cpu" if config.enforce_eager is None else config.enforce_eager


def engine_seed(seed: int, *, rank: int, index: int = 0, per_rank: int = 1) -> int:
    """``rollout.vllm.seed`` plus the engine's place among the run's: no two engines share one."""
    return seed + rank * per_rank + index


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM supports that holds ``rank``; ``ValueError`` above 512."""
    for supported in VLLM_LORA_RANKS:
        if rank <= supported:
            return supported
    raise ValueError(f"lora.rank={rank} is larger than vLLM supports ({VLLM_LORA_RANKS[-1]})")


def requests_per_prompt(params: SamplingParams) -> int:
    """vLLM requests per prompt: one, or one per sample when greedy (vLLM refuses ``n > 1``)."""
    return params.num_samples if params.greedy else 1


def sampling_args(
    params: SamplingParams, *, seed: int, eos_token_id: int | Sequence[int]
) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` fields for one request of ``params``: stopped at
    ``eos_token_id`` (vLLM has no tokenizer), ``seed`` wrapped into vLLM's int32 range."""
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
    """Where vLLM's exports go, and whether it is ours to remove: ``workdir``, else a shared
    temporary directory (collective) the watcher removes if rank 0 dies."""
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


def export_base(engine, workdir: Path, tokenizer, image_encoder) -> Path:
    """``workdir/base``, the engine's base model as vLLM loads it; with images also the tokenizer
    and image processor (vLLM preprocesses images itself)."""
    path = workdir / "base"
    vision = image_encoder is not None
    tokenizer = tokenizer if vision else None
    export_merged_model(engine.module, path, merge_lora=False, tokenizer=tokenizer)
    if vision:
        image_encoder.image_processor.save_pretrained(str(path))
    return path


def remove_workdir(workdir: Path, *, owned: bool) -> None:
    """Remove ``workdir`` on rank 0 when :func:`make_workdir` made it."""
    if owned and distributed.rank() == 0:
        shutil.rmtree(workdir, ignore_errors=True)
        watcher.release("directory", workdir)


def config_options(config: VLLMConfig, device: torch.device) -> dict[str, Any]:
    """The ``rollout.vllm`` keys as :func:`engine_args`'s keywords, resolved for ``device``."""
    return {
        "max_model_len": config.max_model_len,
        "kv_cache_mb": kv_cache_mb(config, device),
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enforce_eager": enforce_eager(config, device),
        "cpu": device.type == "cpu",
    }


def engine_args(
    model: str | os.PathLike,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int = 0,
    kv_cache_mb: int = 0,
    gpu_memory_utilization: float = 0.3,
    enforce_eager: bool = False,
    lora_rank: int = 0,
    max_loras: int = 1,
    images: bool = False,
    cpu: bool = False,
) -> dict[str, Any]:
    """The engine arguments both integrations give vLLM (:data:`OWNED` among them; None: vLLM's
    default, left out); ``lora_rank``: one of :data:`VLLM_LORA_RANKS` (0: no LoRA)."""
    args: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": not images,  # vLLM's multimodal processor reads the tokenizer
        "dtype": dtype,
        "seed": seed,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enforce_eager": enforce_eager,
        "logprobs_mode": "processed_logprobs",
        "generation_config": "vllm",  # our SamplingParams only, not the model's defaults
        "kv_cache_memory_bytes": kv_cache_mb * 1024 * 1024 or None,
        "max_model_len": max_model_len or None,
    }
    if lora_rank:
        args.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=max_loras)
    if images:  # no video processor is profiled
        args["limit_mm_per_prompt"] = {"video": 0}
    if cpu:
        # vLLM 0.32 rewinds a partly computed prompt's generator, which a CPU one refuses.
        args["enable_chunked_prefill"] = False
    return {key: value for key, value in args.items() if value is not None}


def user_engine_args(
    engine_kwargs: Mapping[str, Any], *, owned: Mapping[str, str], valid: Iterable[str] = ()
) -> dict[str, Any]:
    """``rollout.vllm.engine_kwargs``, dashes made underscores; ``ValueError`` naming the key
    for one in ``owned``, in :data:`TYPED_KEYS`, or (given ``valid``) not among vLLM's."""
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
    """``vllm serve`` flags: ``max_num_seqs=64`` -> ``--max-num-seqs 64``; a bool ``--flag`` or
    ``--no-flag``, a list its items, a dict its JSON, None nothing (vLLM's default)."""
    flags: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            values = value if isinstance(value, (list, tuple)) else [value]
            flags += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in values)]
    return flags


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
