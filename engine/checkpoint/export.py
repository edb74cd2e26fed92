"""Export a trained model for the ecosystem: a PEFT adapter, or a merged transformers model.

Plain or FSDP2-sharded: the full state dict is gathered to rank 0 on the CPU one parameter at a
time, then rank 0 writes atomically; every rank must call them. A critic or reward model exports
as a transformers classifier (:func:`classifier_target`), never one that loads with a random
head (docs/engine.md#exports-of-critics-and-reward-models).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from microrl.engine.checkpoint.agreement import rank_agreement
from microrl.engine.checkpoint.atomic_io import refuse_foreign_dir, replace_dir, staging_paths
from microrl.engine.models import ValueModel
from microrl.engine.parallel import distributed

__all__ = [
    "ClassifierTarget",
    "base_state_dict",
    "classifier_state_dict",
    "classifier_target",
    "export_merged_model",
    "export_peft_adapter",
    "full_state_dict",
    "locate_base_model",
    "merged_state_dict",
]

# peft's wrapper levels in state-dict keys (nested for a module with two adapted parameters).
_BASE_LAYERS = re.compile(r"(\.base_layer)+\.")
_PEFT_BASE_PREFIX = "base_model.model."  # where PeftModel keeps the wrapped transformers model


def full_state_dict(model: nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict of ``model`` on the CPU on rank 0 (``{}`` elsewhere);
    ``trainable_only``: the trainable parameters alone (the frozen base is not gathered)."""
    options = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
    )
    state = get_model_state_dict(model, options=options)
    return {k: v.detach() for k, v in state.items()} if distributed.rank() == 0 else {}


def _find(model: nn.Module, cls: type) -> tuple[str, nn.Module] | None:
    for name, module in model.named_modules():
        if isinstance(module, cls):
            return (name + "." if name else ""), module
    return None


def _sub_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _is_export(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def _write_atomically(path: str | os.PathLike, write) -> Path:
    """Rank 0 writes into a temporary directory renamed to ``path``; all raise if it fails."""
    target = Path(path).absolute()
    refuse_foreign_dir(target, _is_export, "a model export")
    with rank_agreement(f"export to {target}"):
        if distributed.rank() == 0:
            tmp, old = staging_paths(target)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                write(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            replace_dir(tmp, target, old)
    return target


def locate_base_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, base)``: the outermost transformers model inside ``model`` and its names' prefix
    in ``model``'s state dict (``"causal_lm."`` in an actor's module); ``ValueError`` if none."""
    from transformers import PreTrainedModel

    found = _find(model, PreTrainedModel)
    if found is None:
        raise ValueError(f"{type(model).__name__} holds no transformers model to export")
    return found


def export_peft_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    peft_model: nn.Module | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the LoRA adapter trained inside ``model`` in PEFT's format.

    Args:
        model: the trained module (e.g. ``engine.module``), sharded or not.
        path: output directory, loadable with ``PeftModel.from_pretrained(base, path)``.
        peft_model: the ``PeftModel`` that injected the adapters (``engine.peft_model``); found
            inside ``model`` when omitted.
        dtype: the dtype written (a LoRA sync: vLLM's adapter dtype); None: as trained (float32).
    """
    from peft import PeftModel

    if peft_model is None:
        found = _find(model, PeftModel)
        peft_model = found[1] if found is not None else None
    if not isinstance(peft_model, PeftModel):
        raise ValueError(
            f"no PeftModel for {type(model).__name__}: there is no adapter to export "
            "(pass peft_model=engine.peft_model when the module holds only the base model)"
        )
    found = _find(model, ValueModel)
    if found is not None:
        return _export_classifier_adapter(model, path, peft_model, found[0], found[1], dtype)
    prefix, base = locate_base_model(model)
    if base is not peft_model.get_base_model():
        raise ValueError("peft_model does not wrap the transformers model inside model")
    trained = _cast(full_state_dict(model, trainable_only=True), dtype)  # every rank takes part
    state = {_PEFT_BASE_PREFIX + k: v for k, v in _sub_state(trained, prefix).items()}

    def write(tmp: Path) -> None:
        peft_model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)

    return _write_atomically(path, write)


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors in ``dtype`` (None: unchanged)."""
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def merged_state_dict(base: nn.Module, state: dict[str, torch.Tensor]) -> dict:
    """Fold each LoRA update ``scaling * B @ A`` into its base weight (float64 sum) in ``base``'s
    full ``state``: ``lora.Linear`` and ``ParamWrapper`` (MoE experts, routers), one adapter each;
    anything else is a ``ValueError`` rather than a silently wrong merge."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer, ParamWrapper
    from peft.utils import ModulesToSaveWrapper

    merged = {k: v for k, v in state.items() if ".lora_" not in k}
    for name, module in base.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            raise ValueError(f"{name}: modules_to_save is not supported by the merged export")
        if not isinstance(module, LoraLayer):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if type(module) not in (LoraLinear, ParamWrapper) or len(adapters) != 1:
            raise ValueError(
                f"{name}: only LoRA Linear layers and parameters with one adapter can merge"
            )
        adapter = adapters[0]
        if module.use_dora.get(adapter, False):
            raise ValueError(f"{name}: DoRA layers are not supported by the merged export")
        a = state[f"{name}.lora_A.{adapter}.weight"].double()
        b = state[f"{name}.lora_B.{adapter}.weight"].double()
        if isinstance(module, ParamWrapper):
            weight_key, delta = _param_wrapper_delta(name, module, a, b)
        else:
            weight_key, delta = f"{name}.base_layer.weight", b @ a
            if module.fan_in_fan_out:
                delta = delta.T
        weight = merged[weight_key]
        merged[weight_key] = (weight.double() + delta * module.scaling[adapter]).to(weight.dtype)
    return base_state_dict(merged)


def _param_wrapper_delta(
    name: str, module: nn.Module, a: torch.Tensor, b: torch.Tensor
) -> tuple[str, torch.Tensor]:
    """The state key of a ``ParamWrapper``'s parameter (a ``base_layer`` per nested wrapper) and its
    unscaled update from ``a`` ``[r * E, in]`` and ``b`` ``[out, r * E]`` (peft's layout)."""
    from peft.tuners.lora import ParamWrapper

    levels, inner = 1, module.base_layer
    while isinstance(inner, ParamWrapper):
        levels, inner = levels + 1, inner.base_layer
    key = f"{name}{'.base_layer' * levels}.{module.parameter_name}"
    experts = module.num_experts
    if experts == 1 and module._param_ndim == 2:  # a plain 2-D weight [out, in]
        return key, b @ a
    a = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, experts)  # [out, r, E]
    swapped = module._did_swap_in_out_features  # the weight is [E, out, in], not [E, in, out]
    return key, torch.einsum("ore,eri->eoi" if swapped else "ore,eri->eio", b, a)


def base_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain state dict under LoRA layers, updates left out (what ``vllm`` loads once)."""
    kept = {k: v for k, v in state.items() if ".lora_" not in k}
    return {_BASE_LAYERS.sub(".", k): v for k, v in kept.items()}


def export_merged_model(
    model: nn.Module, path: str | os.PathLike, *, merge_lora: bool = True, tokenizer: Any = None
) -> Path:
    """Write the trained transformers model inside ``model`` in its own format, LoRA merged in.

    ``AutoModelForCausalLM.from_pretrained(path)`` loads it, in the training dtype;
    ``merge_lora=False`` writes the base under the adapters instead. A ``tokenizer`` is saved in
    the same atomic write, so the directory serves on its own.
    """
    found = _find(model, ValueModel)
    if found is not None:
        return _export_classifier(model, path, found[0], found[1], tokenizer)
    prefix, base = locate_base_model(model)
    state = _sub_state(full_state_dict(model), prefix)
    if distributed.rank() == 0:
        state = merged_state_dict(base, state) if merge_lora else base_state_dict(state)

    def write(tmp: Path) -> None:
        base.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return _write_atomically(path, write)


# ----------------------------------------------------------------- critics and reward models
class ClassifierTarget(NamedTuple):
    """What a critic / reward model exports as (:func:`classifier_target`)."""

    config: Any  # the body's config with num_labels=1 and the classifier's architectures
    base_prefix: str  # the attribute holding the body in that class ("model" for Llama/Qwen2)
    head_name: str  # its Linear(H, 1) head ("score")
    task_type: str  # PEFT's task type: "TOKEN_CLS" or "SEQ_CLS"
    state_keys: frozenset[str]  # the classifier's state-dict keys


def classifier_target(value_model: ValueModel) -> ClassifierTarget:
    """The transformers classifier a critic (``sequence_level=False``) or a reward model exports as.

    A critic's logits ``[b, L, 1]`` are the values at each *predicting* position (the engine's
    ``values[b, t]`` is ``logits[b, t - 1]``); docs/engine.md#exports-of-critics-and-reward-models.
    Raises ``ValueError`` when the architecture has no such class, or its head is not one
    ``Linear(H, 1)`` with the trained head's bias.
    """
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    body = value_model.body
    head = value_model.value_head
    if value_model.sequence_level:
        auto, task, role = AutoModelForSequenceClassification, "SEQ_CLS", "reward model"
    else:
        auto, task, role = AutoModelForTokenClassification, "TOKEN_CLS", "critic"
    kind = auto.__name__[len("AutoModelFor") :]
    config = copy.deepcopy(body.config)
    config.num_labels = 1
    if not value_model.sequence_level:
        config.classifier_dropout = 0.0
        config.token_classification_bias = head.bias is not None
    try:
        with torch.device("meta"):
            target = auto.from_config(config)
    except (ValueError, KeyError) as error:
        raise ValueError(
            f"cannot export this {role}: transformers has no {kind} class for "
            f"{type(config).__name__} ({error}); save_checkpoint keeps the trained body and head"
        ) from None
    name = type(target).__name__
    prefix = target.base_model_prefix
    if type(getattr(target, prefix, None)) is not type(body):
        raise ValueError(
            f"cannot export this {role} as {name}: its {prefix!r} is not a "
            f"{type(body).__name__} (the trained decoder body)"
        )
    heads = [
        (n, m)
        for n, m in target.named_modules()
        if isinstance(m, nn.Linear) and n != prefix and not n.startswith(prefix + ".")
    ]
    if len(heads) != 1 or heads[0][1].weight.shape != head.weight.shape:
        raise ValueError(
            f"cannot export this {role} as {name}: its head is not one Linear(H, 1) "
            f"(found {[n for n, _ in heads]})"
        )
    head_name, target_head = heads[0]
    if (target_head.bias is None) != (head.bias is None):
        raise ValueError(
            f"cannot export this {role} as {name}: the trained head "
            f"{'has a' if head.bias is not None else 'has no'} bias, {name}.{head_name} "
            f"{'has none' if target_head.bias is None else 'has one'}"
        )
    config.architectures = [name]
    return ClassifierTarget(config, prefix, head_name, task, frozenset(target.state_dict()))


def _head_state(
    state: dict[str, torch.Tensor], value_prefix: str, head_name: str
) -> dict[str, torch.Tensor]:
    """The trained head's tensors under the classifier's head name."""
    head = _sub_state(state, value_prefix + "value_head.")
    return {f"{head_name}.{k}": v for k, v in head.items()}


def classifier_state_dict(
    target: ClassifierTarget, value_model: ValueModel, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``target``'s classifier state from ``value_model``'s full ``state``, LoRA merged into the
    body; ``ValueError`` when the keys are not exactly the classifier's."""
    body = merged_state_dict(value_model.body, _sub_state(state, "body."))
    out = {f"{target.base_prefix}.{k}": v for k, v in body.items()}
    out.update(_head_state(state, "", target.head_name))
    if out.keys() != target.state_keys:
        missing = sorted(target.state_keys - out.keys())[:5]
        extra = sorted(out.keys() - target.state_keys)[:5]
        raise ValueError(
            f"cannot export as {target.config.architectures[0]}: state keys differ "
            f"(missing {missing}, unexpected {extra})"
        )
    return out


def _export_classifier(
    model: nn.Module,
    path: str | os.PathLike,
    value_prefix: str,
    value_model: ValueModel,
    tokenizer: Any = None,
) -> Path:
    """:func:`export_merged_model` of a critic / reward model (see :func:`classifier_target`)."""
    from safetensors.torch import save_file

    target = classifier_target(value_model)
    state = full_state_dict(model)  # every rank takes part; rank 0 gets the tensors

    def write(tmp: Path) -> None:  # rank 0, inside the ranks' agreement: a failure reaches all
        out = classifier_state_dict(target, value_model, _sub_state(state, value_prefix))
        target.config.save_pretrained(str(tmp))
        tensors = {k: v.contiguous() for k, v in out.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return _write_atomically(path, write)


def _export_classifier_adapter(
    model: nn.Module,
    path: str | os.PathLike,
    peft_model: nn.Module,
    value_prefix: str,
    value_model: ValueModel,
    dtype: torch.dtype | None = None,
) -> Path:
    """:func:`export_peft_adapter` of a critic / reward model: adapter plus head to save."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    target = classifier_target(value_model)
    base = peft_model.get_base_model()
    body_name = next((n for n, m in base.named_modules() if m is value_model.body), None)
    if body_name is None:
        raise ValueError("peft_model does not wrap the decoder body inside model")
    if body_name != target.base_prefix:
        raise ValueError(
            f"cannot export this adapter for {target.config.architectures[0]}: the adapted body "
            f"is {body_name!r} in the causal LM but {target.base_prefix!r} in the classifier, so "
            "the adapter's module names would not match"
        )
    adapter = peft_model.active_adapter
    peft_config = copy.deepcopy(peft_model.peft_config[adapter])
    peft_config.task_type = target.task_type
    peft_config.modules_to_save = [target.head_name]
    # The adapters and the head: every rank takes part; rank 0 gets the tensors.
    state = _cast(full_state_dict(model, trainable_only=True), dtype)

    def write(tmp: Path) -> None:  # rank 0, inside the ranks' agreement: a failure reaches all
        body = _sub_state(state, value_prefix + "body.")
        peft_state = {f"{_PEFT_BASE_PREFIX}{body_name}.{k}": v for k, v in body.items()}
        out = get_peft_model_state_dict(peft_model, state_dict=peft_state, adapter_name=adapter)
        head = _head_state(state, value_prefix, target.head_name)
        out.update({_PEFT_BASE_PREFIX + k: v for k, v in head.items()})
        peft_config.save_pretrained(str(tmp))
        tensors = {k: v.contiguous() for k, v in out.items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    return _write_atomically(path, write)
