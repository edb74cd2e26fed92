"""Typed config of the rollout backends (docs/rollouts.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from microrl.configs.fields import config_field

__all__ = ["ROLLOUT_BACKENDS", "VLLMConfig", "parse_gpu_list"]

ROLLOUT_BACKENDS = ("hf", "vllm")


@dataclass
class VLLMConfig:
    """The colocated ``vllm.LLM`` of the ``vllm`` backend, and the ``vllm serve`` servers of
    asynchronous RL (ignored by ``hf``).

    vLLM's ``gpu_memory_utilization`` is the fraction of the device's memory vLLM may take in
    all (weights and KV cache), so on a GPU shared with training it must leave room for the
    trainer; on a CPU vLLM reads it as a fraction of the machine's memory, which is why the KV
    cache gets a fixed size there (``kv_cache_memory_mb``). ``gpus``, ``tensor_parallel_size``
    and ``trainer_address`` place the servers and reach them (docs/async.md#vllm-servers);
    ``engine_kwargs`` passes any other vLLM engine argument through
    (docs/rollouts.md#vllm-engine-arguments); ``sleep_level`` frees the in-process engine's
    memory while the trainer trains (docs/rollouts.md#sleep-mode).
    """

    gpu_memory_utilization: float = config_field(
        0.3, "fraction of device memory vLLM may use (GPU)"
    )
    kv_cache_memory_mb: int = config_field(
        0, "KV cache size in MiB; 0: vLLM sizes it on a GPU, 256 MiB on a CPU"
    )
    dtype: str = config_field(
        "auto",
        "vLLM's compute dtype; auto: the trainer's (bfloat16 on CUDA, the model's storage dtype "
        "on a CPU)",
    )
    enforce_eager: bool | None = config_field(None, "no CUDA graphs; null: eager on CPU only")
    max_model_len: int = config_field(0, "longest prompt + response; 0: the model's maximum")
    seed: int = config_field(
        0, "vLLM's engine seed (each engine adds its place among the run's engines)"
    )
    verbose: bool = config_field(
        False, "vLLM's own INFO/WARNING logs and load bar (false: errors only)"
    )
    gpus: str = config_field(
        "",
        "vLLM servers: comma-separated GPUs (cuda:N numbering) dedicated to the local servers, "
        "each trainer process taking its share in local-rank order; empty: each server on its "
        "trainer process's own GPU",
    )
    tensor_parallel_size: int = config_field(
        1, "vLLM servers: GPUs per local server (vllm serve --tensor-parallel-size; needs gpus)"
    )
    trainer_address: str = config_field(
        "",
        "vLLM servers, full fine-tune: this host's address as the servers reach it (the weight "
        "rendezvous); empty: the local address of the route to each server",
    )
    engine_kwargs: dict[str, Any] = config_field(
        {},
        "more vLLM engine arguments (vllm.LLM keywords; vllm serve flags for local servers), "
        "e.g. rollout.vllm.engine_kwargs.max_num_seqs=64; keys microrl owns are refused",
    )
    sleep_level: int = config_field(
        0,
        "in-process engine on a GPU: vLLM's sleep mode while the trainer trains (0: off; 1: "
        "weights to host memory, KV cache freed; 2: both freed, weights reloaded at wake-up)",
    )

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "vllm.gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization!r}"
            )
        for key in ("kv_cache_memory_mb", "max_model_len"):
            if getattr(self, key) < 0:
                raise ValueError(f"vllm.{key} must be >= 0, got {getattr(self, key)!r}")
        if isinstance(self.tensor_parallel_size, bool) or not (
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1
        ):
            raise ValueError(
                f"vllm.tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}"
            )
        parse_gpu_list(self.gpus)  # its ValueError names vllm.gpus
        if not isinstance(self.engine_kwargs, dict) or not all(
            isinstance(k, str) for k in self.engine_kwargs
        ):
            raise ValueError(
                "vllm.engine_kwargs must be a mapping of vLLM argument names to values, "
                f"got {self.engine_kwargs!r}"
            )
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"vllm.sleep_level must be 0, 1 or 2, got {self.sleep_level!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"vllm.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )


def parse_gpu_list(text: str) -> list[int]:
    """``"4,5,6,7"`` -> ``[4, 5, 6, 7]`` (``""``: ``[]``); a ``ValueError`` naming ``vllm.gpus``
    for anything but distinct integers >= 0."""
    if not isinstance(text, str):
        raise ValueError(f"vllm.gpus must be a comma-separated string like '4,5', got {text!r}")
    items = [item.strip() for item in text.split(",")] if text.strip() else []
    if not all(item.isdigit() for item in items):
        raise ValueError(
            f"vllm.gpus must list GPU indices >= 0, comma-separated (like '4,5,6,7'), got {text!r}"
        )
    gpus = [int(item) for item in items]
    duplicates = sorted({g for g in gpus if gpus.count(g) > 1})
    if duplicates:
        raise ValueError(
            f"vllm.gpus must list each GPU once (GPU {duplicates[0]} is there twice), got {text!r}"
        )
    return gpus
