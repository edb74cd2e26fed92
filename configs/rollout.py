"""Typed config of the rollout backends (docs/rollouts.md)."""

from __future__ import annotations

from dataclasses import dataclass

from microrl.configs.fields import config_field

__all__ = ["ROLLOUT_BACKENDS", "VLLMConfig"]

ROLLOUT_BACKENDS = ("hf", "vllm")


@dataclass
class VLLMConfig:
    """The colocated ``vllm.LLM`` of the ``vllm`` backend (ignored by ``hf``).

    vLLM's ``gpu_memory_utilization`` is the fraction of the device's memory vLLM may take in
    all (weights and KV cache), so on a GPU shared with training it must leave room for the
    trainer; on a CPU vLLM reads it as a fraction of the machine's memory, which is why the KV
    cache gets a fixed size there (``kv_cache_memory_mb``).
    """

    gpu_memory_utilization: float = config_field(
        0.3, "fraction of device memory vLLM may use (GPU)"
    )
    kv_cache_memory_mb: int = config_field(
        0, "KV cache size in MiB; 0: vLLM sizes it on a GPU, 256 MiB on a CPU"
    )
    dtype: str = config_field("auto", "vLLM's compute dtype; auto: the trained model's dtype")
    enforce_eager: bool | None = config_field(None, "no CUDA graphs; null: eager on CPU only")
    max_model_len: int = config_field(0, "longest prompt + response; 0: the model's maximum")
    seed: int = config_field(0, "vLLM's sampling seed (each rank adds its rank)")
    verbose: bool = config_field(
        False, "vLLM's own INFO/WARNING logs and load bar (false: errors only)"
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
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"vllm.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
