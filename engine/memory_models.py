"""What :func:`~microrl.engine.memory.estimate_memory` adds beside the trained model's step: frozen
teacher or reward models, ``hf`` generation's gathered weights, image pixels (docs/gpu.md).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from microrl.configs.engine import EngineConfig
from microrl.engine import setup
from microrl.engine.memory_activations import (
    KERNEL_TILES,
    Numerics,
    Shape,
    backward_bytes_per_token,
    decoder_layers,
)
from microrl.kernels import WORKING_TILE_ELEMENTS

__all__ = [
    "frozen_model_bytes",
    "hf_gathered_bytes",
    "image_token_bytes",
    "reward_model_bytes",
    "shard_numel",
    "teacher_bytes",
]

# Pixels travel in float32, as the image processor returns them (docs/batch.md#images).
PIXEL_BYTES = 4


def shard_numel(p: torch.Tensor, world_size: int) -> int:
    """Elements of ``p`` on one rank: sharded on dim 0, padded to a multiple of the world size."""
    if world_size == 1 or p.dim() == 0:
        return p.numel()
    return math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0])


def frozen_model_bytes(
    model: nn.Module,
    model_config: Any,
    num: Numerics,
    *,
    tokens: int,
    world_size: int,
    device: str,
    logits: int,
) -> tuple[int, int]:
    """``(weights, forward)`` of a frozen meta ``model``: its parameters sharded over
    ``world_size``, and a no-grad forward over ``tokens`` (one layer in flight, ``logits`` fp32
    elements, under FSDP2 the gathered root and two layers)."""
    weights = sum(shard_numel(p, world_size) * p.element_size() for p in model.parameters())
    forward = tokens * backward_bytes_per_token(Shape.of(model_config), num) + logits * 4
    if world_size > 1:
        layer = max((_numel(m) for m in decoder_layers(model)), default=0)
        head = model.get_output_embeddings() or getattr(model, "score", None)
        root = _numel(head) + _numel(getattr(model.get_decoder(), "norm", None))
        itemsize = next(model.parameters()).element_size()
        forward += (root + 2 * layer) * (2 if device == "cuda" else itemsize)
    return weights, forward


def reward_model_bytes(
    model_config: Any, config: EngineConfig, tokens: int, world_size: int, device: str
) -> dict[str, int]:
    """A ``task.reward_model``: weights in the run's compute dtype (fp32 score head), sharded, and
    its no-grad forward over ``tokens`` (no logits)."""
    from transformers import AutoModelForSequenceClassification

    dtype = setup.autocast_dtype(config, device) or torch.float32
    classifier = copy.copy(model_config)
    classifier.num_labels = 1
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(classifier, dtype=dtype)
    # Stored in its compute dtype, so every activation is in it too (no casts, no LoRA).
    size = dtype.itemsize
    num = Numerics(stream=size, act=size, saved_input=size, copies=False, full=True)
    weights, forward = frozen_model_bytes(
        model, model_config, num, tokens=tokens, world_size=world_size, device=device, logits=0
    )
    head = model.score.weight  # the engine's score head is float32
    weights += shard_numel(head, world_size) * (4 - head.element_size())
    return {"reward_model_weights": weights, "reward_model_forward": forward}


def teacher_bytes(
    model_config: Any, config: EngineConfig, tokens: int, world_size: int, device: str, num
) -> dict[str, int]:
    """A frozen teacher's weights (``base_dtype``, sharded) and no-grad forward transient."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=setup.base_dtype(config))
    logits = teacher_logits(Shape.of(model_config), config, tokens)
    weights, forward = frozen_model_bytes(
        model, model_config, num, tokens=tokens, world_size=world_size, device=device, logits=logits
    )
    return {"teacher_weights": weights, "teacher_forward": forward}


def teacher_logits(shape: Shape, config: EngineConfig, tokens: int) -> int:
    """Float32 logits a frozen lm head holds over ``tokens`` (tiles past the kernel's budget)."""
    logits = tokens * shape.vocab
    if config.use_fused_kernel:
        logits = min(logits, KERNEL_TILES * WORKING_TILE_ELEMENTS)
    return logits


def hf_gathered_bytes(model: nn.Module, world_size: int, device: str, sharded: bool) -> int:
    """The policy's full weights FSDP2 gathers beside the shards for ``hf`` generation (bf16 on
    CUDA); 0 for an unsharded model."""
    if not sharded:
        return 0
    return sum(
        p.numel() * (2 if device == "cuda" else p.element_size()) for p in model.parameters()
    )


def image_token_bytes(vision_config: Any) -> int:
    """Pixel bytes of one image token: ``merge**2`` fp32 patches (Qwen2-VL: 18816)."""
    patch_dim = (
        vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    )
    return vision_config.spatial_merge_size**2 * patch_dim * PIXEL_BYTES


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())
