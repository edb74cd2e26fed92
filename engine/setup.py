"""Model preparation shared by every engine role: load, place, LoRA, gradient checkpointing."""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from microrl.configs.engine import EngineConfig, LoraConfig

__all__ = [
    "apply_lora",
    "autocast_context",
    "enable_gradient_checkpointing",
    "load_causal_lm",
    "resolve_device",
]


def resolve_device(config: EngineConfig) -> torch.device:
    """``device="auto"``: the current CUDA device when there is one, else the CPU."""
    if config.device == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else (torch.device("cpu"))
        )
    return torch.device(config.device)


def autocast_context(config: EngineConfig, device: torch.device) -> Any:
    """bf16 autocast on CUDA for ``dtype="auto"`` (and anywhere for ``"bfloat16"``), else none.

    Parameters and optimizer state stay in their own dtype (fp32 by default); the engine casts every
    output to fp32.
    """
    use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda")
    if not use_bf16:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def load_causal_lm(model: nn.Module | str | os.PathLike) -> nn.Module:
    """A transformers ``PreTrainedModel`` as given, or loaded in fp32 from a local checkpoint path."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise ValueError(f"model path {path!r} is not a local checkpoint directory")
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a transformers PreTrainedModel or a checkpoint path, got "
            f"{type(model).__name__}"
        )
    return model


def apply_lora(model: nn.Module, config: LoraConfig) -> tuple[nn.Module, nn.Module | None]:
    """Inject LoRA adapters with peft when ``config.rank > 0``.

    Returns ``(model, peft_model)``: ``model`` is the same causal LM object with adapter layers
    injected (its base weights frozen by peft), ``peft_model`` the ``PeftModel`` that owns the
    adapters (``disable_adapter()``, ``save_pretrained()``), or ``None`` without LoRA.
    """
    if config.rank == 0:
        return model, None
    import peft

    lora = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
    )
    peft_model = peft.get_peft_model(model, lora)
    return peft_model.get_base_model(), peft_model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer.

    Non-reentrant checkpointing re-runs the layer under autograd's saved-tensor hooks, so the
    LoRA parameters inside get gradients even when the embedding (the checkpoint's only input) is
    frozen; the reentrant variant would need ``enable_input_require_grads``.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
