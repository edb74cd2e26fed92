"""Model preparation shared by every engine role: load, place, LoRA, gradient checkpointing."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from microrl.configs.engine import BASE_DTYPES, EngineConfig, LoraConfig
from microrl.engine.parallel import distributed

__all__ = [
    "apply_lora",
    "autocast_context",
    "autocast_dtype",
    "base_dtype",
    "cast_base_weights",
    "checkpoint_dir",
    "disable_dropout",
    "enable_gradient_checkpointing",
    "frozen_dtype",
    "load_causal_lm",
    "resolve_device",
]


def resolve_device(config: EngineConfig) -> torch.device:
    """The engine's device, always with an index on a GPU: ``"auto"`` is this rank's GPU when
    there is one (``LOCAL_RANK`` under torchrun), else the CPU; ``"cuda"`` is this rank's GPU; an
    explicit one must exist here (a ``ValueError`` naming ``device`` otherwise: torch would only
    fail at the first allocation, without naming the setting)."""
    if config.device == "auto":
        index = distributed.local_cuda_index()
        return torch.device("cpu") if index is None else torch.device("cuda", index)
    if config.device == "cuda" and torch.cuda.is_available():
        # By index: a bare "cuda" is the current device, GPU 0 in a process that never set one.
        return torch.device("cuda", distributed.local_cuda_index())
    try:
        device = torch.device(config.device)
    except (RuntimeError, TypeError):
        raise ValueError(
            "device must be 'auto' or a torch device string such as 'cpu', 'cuda' or 'cuda:1', "
            f"got {config.device!r}"
        ) from None
    if device.type == "cpu":
        return device
    count = _device_count(device.type)
    if count == 0:
        raise ValueError(
            f"device={config.device!r}, but no {device.type} device is available to torch here "
            f"(torch {torch.__version__}); use device='auto' (an accelerator when there is one, "
            "else the CPU) or device='cpu'"
        )
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"device={config.device!r}, but only {count} {device.type} device(s) are visible "
            f"(indices 0..{count - 1})"
        )
    return device


def _device_count(device_type: str) -> int:
    """How many devices of ``device_type`` torch can use here (0: none, or not a compute device)."""
    if device_type == "mps":
        return int(torch.backends.mps.is_available())
    # torch.cuda, torch.xpu, torch.mtia, ...: the accelerator modules share this interface.
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    if not callable(is_available) or not is_available():
        return 0
    count = getattr(module, "device_count", None)
    return int(count()) if callable(count) else 1


def autocast_dtype(config: EngineConfig, device: torch.device | str) -> torch.dtype | None:
    """The dtype the engine autocasts to: bf16 on CUDA for ``dtype="auto"`` (and anywhere for
    ``"bfloat16"``), else None (no autocast)."""
    device_type = torch.device(device).type
    use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device_type == "cuda")
    return torch.bfloat16 if use_bf16 else None


def autocast_context(config: EngineConfig, device: torch.device) -> Any:
    """Autocast to :func:`autocast_dtype`, else none; parameters and optimizer state keep their
    dtype (fp32 by default) and the engine casts every output to fp32."""
    dtype = autocast_dtype(config, device)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def frozen_dtype(config: EngineConfig, device: torch.device | str) -> torch.dtype:
    """The storage dtype of a frozen engine's weights (``Engine(..., frozen=True)``): the dtype
    it computes in (bf16 under autocast, else ``config.base_dtype``); nothing trains, so no fp32
    master weights are needed."""
    return autocast_dtype(config, device) or base_dtype(config)


def base_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype the frozen base weights are stored in (``config.base_dtype``)."""
    return BASE_DTYPES[config.base_dtype]


def auto_model_class(config: Any) -> type:
    """The transformers auto class a model of ``config`` is built or loaded as: a
    vision-language config's image-text class (tower and lm head), else the causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(config, "vision_config", None) is not None
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


def load_causal_lm(
    model: nn.Module | str | os.PathLike, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A transformers ``PreTrainedModel``, or one loaded from a local checkpoint path.

    ``dtype``: the base weights' storage dtype (:func:`base_dtype`); a path is loaded straight
    into it, a model object is cast only to a 16-bit one (fp64 test models stay fp64).
    """
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        path = checkpoint_dir(model)
        return auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=dtype)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a transformers PreTrainedModel or a checkpoint path, got "
            f"{type(model).__name__}"
        )
    if dtype.itemsize < 4:
        cast_base_weights(model, dtype)
    return model


@torch.no_grad()
def cast_base_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating-point parameter of ``model`` in ``dtype``, in place, before LoRA;
    buffers keep theirs (rotary ``inv_freq`` stays fp32), tied weights stay tied."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def checkpoint_dir(model: str | os.PathLike) -> str:
    """``model`` as a path string; a ``ValueError`` naming it unless a local directory."""
    path = os.fspath(model)
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a local checkpoint directory")
    return path


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability of ``model`` to 0, in place; returns what was non-zero.

    Dropout would make the first on-policy ratio differ from 1. The rates live in ``nn.Dropout*``
    modules, in float attributes named like a drop rate (Qwen2's ``attention_dropout``), and in
    the model config and its sub-configs (read in ``forward`` by Gemma 2).
    """
    changed: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p:
                changed.append(f"{name}.p" if name else "p")
                module.p = 0.0
            continue
        for attr, value in list(vars(module).items()):
            if _is_drop_rate(attr, value):
                changed.append(f"{name}.{attr}" if name else attr)
                setattr(module, attr, 0.0)
    from transformers import PretrainedConfig

    seen: set[int] = set()
    pending = [("config", getattr(model, "config", None))]
    while pending:
        prefix, config = pending.pop()
        if not isinstance(config, PretrainedConfig) or id(config) in seen:
            continue
        seen.add(id(config))
        for attr, value in list(vars(config).items()):
            if isinstance(value, PretrainedConfig):  # a composite model's text/vision config
                pending.append((f"{prefix}.{attr}", value))
            elif _is_drop_rate(attr, value):
                changed.append(f"{prefix}.{attr}")
                setattr(config, attr, 0.0)
    return changed


def _is_drop_rate(name: str, value: object) -> bool:
    """A non-zero probability stored under a drop-rate name (``*dropout*``, ``*pdrop*``,
    ``*layerdrop*``, ``drop_path_rate``, ...); ints, bools and other floats are left alone."""
    return "drop" in name.lower() and isinstance(value, float) and 0.0 < value <= 1.0


def apply_lora(
    model: nn.Module, config: LoraConfig, *, exclude: list[str] | None = None
) -> tuple[nn.Module, nn.Module | None]:
    """Inject LoRA adapters with peft when ``config.rank > 0``.

    ``config.target_modules``: None is peft's ``"all-linear"``, a string goes to peft as is, a
    list (and ``target_parameters``) is checked first, naming the model's own layer names.
    ``exclude``: module names that get no adapter (a frozen vision tower's).

    Returns ``(model, peft_model)``: the same causal LM with adapters injected (base frozen,
    adapters in fp32 whatever the base's dtype) and the ``PeftModel`` owning them, or ``None``.
    ``ValueError`` naming ``lora.target_modules``/``target_parameters``/``dropout`` when bad.
    """
    if config.rank == 0:
        return model, None
    import peft

    targets = config.target_modules
    if targets is None:
        targets = "all-linear"
    elif not isinstance(targets, str):
        targets = list(targets)
        unmatched = _unmatched(targets, model.named_modules())
        if unmatched:
            raise ValueError(
                f"lora.target_modules names {unmatched} that match no module of "
                f"{type(model).__name__}; layers LoRA can adapt here: {_adaptable_names(model)} "
                "(or leave lora.target_modules unset: every linear layer but the output head)"
            )
    parameters = config.target_parameters
    unmatched = _unmatched(parameters or [], model.named_parameters())
    if unmatched:
        raise ValueError(
            f"lora.target_parameters names {unmatched} that match no parameter of "
            f"{type(model).__name__}; its fused (3-D) parameters: {_fused_names(model)}"
        )
    lora = peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        target_parameters=parameters,
        exclude_modules=exclude or None,
        bias="none",
    )
    with warnings.catch_warnings():
        # GPT-2's Conv1D stores its weight transposed; peft notices and adapts correctly.
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
        # A deprecated alias peft reads (transformers >= 5.24); False here: checkpointing is later.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        # Qwen MoE's doubled gate_up_proj rank pattern never matches parameter targets: rank kept.
        warnings.filterwarnings(
            "ignore", message="The following (rank|alpha)_pattern keys did not match"
        )
        try:
            peft_model = peft.get_peft_model(model, lora, autocast_adapter_dtype=True)
        except ValueError as err:  # e.g. a regular expression that matches nothing
            if "lora_dropout" in str(err):  # peft adapts parameters (MoE experts) without dropout
                raise ValueError(
                    f"lora.dropout must be 0 when LoRA adapts parameters directly ({err}): "
                    "lora.target_parameters, or the experts and router that peft's 'all-linear' "
                    f"adapts in {type(model).__name__}; set lora.dropout=0"
                ) from err
            raise ValueError(
                f"lora.target_modules={targets!r} could not be applied to "
                f"{type(model).__name__} ({err}); layers LoRA can adapt here: "
                f"{_adaptable_names(model)}"
            ) from err
    return peft_model.get_base_model(), peft_model


def _unmatched(targets: list[str], named: Iterable[tuple[str, object]]) -> list[str]:
    """The ``targets`` no name of ``named`` matches by peft's rule (the name or a dotted suffix)."""
    names = [name for name, _ in named]
    return [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]


def _adaptable_names(model: nn.Module, limit: int = 20) -> str:
    """The distinct short names of the layers LoRA supports (linear, Conv1D, embeddings)."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, Conv1D)
    names = _short_names((n, m) for n, m in model.named_modules() if n and isinstance(m, kinds))
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _fused_names(model: nn.Module) -> str:
    """The distinct short names of the model's 3-D parameters (fused MoE expert weights)."""
    return ", ".join(_short_names(p for p in model.named_parameters() if p[1].dim() == 3)) or "none"


def _short_names(named: Iterable[tuple[str, object]]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, _ in named})


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer: LoRA parameters inside get
    gradients even when the embedding (the checkpoint's only input) is frozen."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
