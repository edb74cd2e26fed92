"""Typed config of the rollout backends (docs/rollouts.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from microrl.configs.fields import config_field

__all__ = ["ROLLOUT_BACKENDS", "VLLMConfig"]

ROLLOUT_BACKENDS = ("hf", "vllm")


@dataclass
class VLLMConfig:
    """The colocated ``vllm.LLM`` of the ``vllm`` backend (ignored by ``hf``).

    vLLM's ``gpu_memory_utilization`` is the fraction of the device's memory vLLM may take in
    all (weights and KV cache), so on a GPU shared with training it must leave room for the
    trainer; on a CPU vLLM reads it as a fraction of the machine's memory, which is why the KV
    cache gets a fixed size there (``kv_cache_memory_mb``). ``engine_kwargs`` passes any other
    vLLM engine argument through (docs/rollouts.md#vllm-engine-arguments); ``sleep_level``
    frees the in-process engine's memory while the trainer trains (docs/rollouts.md#sleep-mode).
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
    seed: int = config_field(0, "vLLM's sampling seed (each rank adds its rank)")
    verbose: bool = config_field(
        False, "vLLM's own INFO/WARNING logs and load bar (false: errors only)"
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
