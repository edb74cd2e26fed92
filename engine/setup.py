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
    """The engine's device, always with an index on a GPU: ``device="auto"`` is this rank's GPU
    when there is one (``LOCAL_RANK`` under torchrun:
    :func:`~microrl.engine.parallel.distributed.local_cuda_index`), else the CPU; ``"cuda"`` is
    this rank's GPU; an explicit one must exist on this machine.

    Checked here, at construction, because torch only fails at the first allocation, deep inside
    (``AssertionError: Torch not compiled with CUDA enabled``), without naming the setting.

    Raises:
        ValueError: naming ``device``: not a device string, or a device this machine lacks.
    """
    if config.device == "auto":
        index = distributed.local_cuda_index()
        return torch.device("cpu") if index is None else torch.device("cuda", index)
    if config.device == "cuda" and torch.cuda.is_available():
        # This rank's own GPU, by index: a bare "cuda" means the current device, which a
        # process that never set one (a spawned worker, vLLM) reads as GPU 0.
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
    """bf16 autocast on CUDA for ``dtype="auto"`` (and anywhere for ``"bfloat16"``), else none.

    Parameters and optimizer state stay in their own dtype (fp32 by default); the engine casts every
    output to fp32.
    """
    dtype = autocast_dtype(config, device)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def frozen_dtype(config: EngineConfig, device: torch.device | str) -> torch.dtype:
    """The storage dtype of a frozen engine's weights (``Engine(..., frozen=True)``, a reward
    model that only scores): the dtype it computes in, bf16 under autocast, else
    ``config.base_dtype``. Nothing trains, so no fp32 master weights are needed (the
    ``base_dtype`` rule for a full fine-tune does not apply)."""
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

    ``dtype``: the base weights' storage dtype (:func:`base_dtype`). A path is loaded straight
    into it (``from_pretrained(..., dtype=dtype)``: a 16-bit base never exists in fp32 here); a
    model object keeps its own dtype for float32 (fp64 models of exactness tests stay fp64) and
    has its parameters cast for a 16-bit dtype (:func:`cast_base_weights`).
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
    """Store every floating-point parameter of ``model`` in ``dtype``, in place, before LoRA.

    Parameters only, as ``from_pretrained(dtype=...)`` does: buffers keep their dtype (rotary
    ``inv_freq`` stays fp32, so positions are not rounded). LoRA comes after and peft stores the
    adapters in fp32 (``autocast_adapter_dtype``); the role's new heads are fp32 too, so only the
    frozen base is 16-bit. Tied weights stay tied (``param.data`` is replaced, the shared
    ``Parameter`` object is kept).
    """
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def checkpoint_dir(model: str | os.PathLike) -> str:
    """``model`` as a path string, checked to be a local directory.

    Raises:
        ValueError: naming the path when it is not a directory (no hub download happens here).
    """
    path = os.fspath(model)
    if not os.path.isdir(path):
        raise ValueError(f"model path {path!r} is not a local checkpoint directory")
    return path


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability of ``model`` to 0, in place; returns what was non-zero.

    RL needs the training forward to be the function that produced the rollout's and the old
    log-probs (eval mode): dropout would make the first on-policy ratio differ from 1 and feed
    noise into clipping, KL and importance weights. Three places hold the rates:

    * ``nn.Dropout*`` modules (GPT-2's ``attn_pdrop``/``resid_pdrop``/``embd_pdrop``; its SDPA
      path reads ``self.attn_dropout.p``);
    * float attributes of modules named like a drop rate, read functionally in ``forward``
      (Qwen2/Llama attention's ``attention_dropout``, OPT's ``dropout`` and ``layerdrop``);
    * the model config (and its sub-configs), which some models read in ``forward`` (Gemma 2's
      ``self.config.attention_dropout``) -- so an exported checkpoint carries the zeros too.
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

    ``config.target_modules``: None adapts every linear layer but the output head (peft's
    ``"all-linear"``, which also covers GPT-2's ``Conv1D``); a string goes to peft as is; a list
    is checked first, so that a name matching nothing is an error naming the setting and the
    model's own layer names rather than peft's bare "not found" (or a silently smaller adapter).

    Returns ``(model, peft_model)``: ``model`` is the same causal LM object with adapter layers
    injected (its base weights frozen by peft), ``peft_model`` the ``PeftModel`` that owns the
    adapters (``disable_adapter()``, ``save_pretrained()``), or ``None`` without LoRA. The
    adapters are float32 whatever the base's dtype (``autocast_adapter_dtype``: over a 16-bit
    base, peft initialises them, rounds them to the base's dtype and stores them in float32).

    ``exclude``: full module names that get no adapter whatever the targets (a frozen vision
    tower's, docs/engine.md#images).

    ``config.target_parameters``: parameters adapted directly by peft (a mixture-of-experts
    model's fused expert weights), each name checked against the model's parameters first.

    Raises:
        ValueError: naming ``lora.target_modules`` (or ``lora.target_parameters``) when its names
            select no (or not every) layer (parameter), and ``lora.dropout`` when an adapted
            parameter cannot take dropout.
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
        # peft's PeftModel reads the model's `is_gradient_checkpointing`, a deprecated alias of
        # `is_activation_checkpointing` since transformers 5.24 (a FutureWarning on every run);
        # it is False here either way: checkpointing is enabled after LoRA.
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        # peft maps Qwen2/Qwen3-MoE's pre-v5 module names onto the fused expert parameters and
        # sets a doubled rank for the fused gate_up_proj by a module pattern that parameter
        # targets never match: the adapter keeps lora.rank, as configured.
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
    """The ``targets`` no name of ``named`` (modules or parameters) matches."""
    names = [name for name, _ in named]
    return [t for t in targets if not any(_matches(n, t) for n in names)]


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a list entry: the full module name or its dotted suffix."""
    return module_name == target or module_name.endswith(f".{target}")


def _adaptable_names(model: nn.Module, limit: int = 20) -> str:
    """The distinct short names of the layers LoRA supports (linear, Conv1D, embeddings)."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, Conv1D)
    names = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, kinds)}
    )
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _fused_names(model: nn.Module) -> str:
    """The distinct short names of the model's 3-D parameters (fused MoE expert weights)."""
    names = sorted({n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.dim() == 3})
    return ", ".join(names) or "none"


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
