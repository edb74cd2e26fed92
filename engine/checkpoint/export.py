"""Export a trained model for the ecosystem: a PEFT adapter, or a merged transformers model.

Both work on a plain or an FSDP2-sharded module: the full state dict is gathered to rank 0 on the
CPU first (``full_state_dict=True, cpu_offload=True``: one parameter at a time, so no rank ever
holds two full copies on the accelerator), then rank 0 writes. Every rank must call them.

* :func:`export_peft_adapter` writes what ``PeftModel.from_pretrained(base, path)`` loads.
* :func:`export_merged_model` writes what ``AutoModelForCausalLM.from_pretrained(path)`` loads:
  the base weights with each LoRA update ``W + scaling * B @ A`` folded in.

A critic or a reward model (a :class:`~microrl.engine.models.ValueModel`: decoder body plus a
``Linear(H, 1)`` head) is not a causal LM: it exports as the architecture's transformers
classifier with ``num_labels=1`` and the trained head as its ``score`` layer --
``*ForTokenClassification`` for a critic (a value per position; the head's bias is kept), and
``*ForSequenceClassification`` for a reward model (a score pooled at the last token; no bias).
An architecture without that class, or whose class has a different head layout, is a
``ValueError`` that says so: never a model that loads with a random head.

Writes are atomic like checkpoints (a temporary directory renamed into place).
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
    """The unsharded state dict of ``model`` on the CPU on rank 0 (``{}`` on the other ranks);
    ``trainable_only``: the parameters that train alone (an adapter: the frozen base, most of
    the bytes, is neither gathered nor copied)."""
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
    """Rank 0 runs ``write(tmp_dir)`` and renames ``tmp_dir`` to ``path``; all ranks wait, and
    all raise if rank 0 fails (a bare barrier would leave the others blocked)."""
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
    """``(prefix, base)``: the outermost transformers ``PreTrainedModel`` inside ``model`` (e.g.
    ``engine.module``, plain, peft-wrapped or FSDP2-sharded) and the prefix of its parameter
    names in ``model``'s state dict (``"causal_lm."`` in an actor's module; ``""`` when ``model``
    is it).

    Raises ``ValueError`` when ``model`` holds no transformers model.
    """
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
        dtype: the dtype its floating-point tensors are written in (a LoRA sync's: the one
            vLLM holds the adapter in, :func:`~microrl.rollout.samplers.vllm_options.adapter_dtype`,
            half the bytes for bfloat16); None: as trained (float32).
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
    """Fold each LoRA update ``scaling * B @ A`` into its base weight (float64 sum).

    Args:
        base: the transformers model with LoRA layers injected by peft.
        state: its full state dict (keys relative to ``base``).

    Returns the state dict of the plain transformers model (no ``base_layer`` or ``lora_`` keys).
    Supported: plain ``lora.Linear`` layers and peft's ``ParamWrapper`` (LoRA on a parameter: a
    mixture-of-experts model's fused 3-D expert weights, its router), one active adapter each
    (what the engine builds); anything else is a ``ValueError`` rather than a silently wrong
    merge.
    """
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
    """The state key of the parameter a peft ``ParamWrapper`` adapts and its unscaled update
    from the factors ``a`` ``[r * E, in]`` and ``b`` ``[out, r * E]`` (peft's own layout, as its
    ``get_delta_weight``). Wrappers nest, one per adapted parameter of a module, each adding a
    ``base_layer`` level to the names below it."""
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
    """The plain transformers state dict under LoRA layers, without their updates: ``lora_``
    keys dropped, ``base_layer`` weights under their original names (every nested level: a
    module with two adapted parameters has two), which a ``vllm`` rollout backend loads once and
    applies the adapter on top of."""
    kept = {k: v for k, v in state.items() if ".lora_" not in k}
    return {_BASE_LAYERS.sub(".", k): v for k, v in kept.items()}


def export_merged_model(
    model: nn.Module, path: str | os.PathLike, *, merge_lora: bool = True, tokenizer: Any = None
) -> Path:
    """Write the trained transformers model inside ``model`` in its own format, LoRA merged in.

    ``AutoModelForCausalLM.from_pretrained(path)`` loads it. Without LoRA it is the fine-tuned
    model itself; the weights keep their training dtype. ``merge_lora=False`` writes the base
    model under the adapters instead (their updates left out). A critic or a reward model (a
    :class:`~microrl.engine.models.ValueModel` inside ``model``) is written as a transformers
    classifier instead (see :func:`classifier_target`): ``AutoModelForTokenClassification`` /
    ``AutoModelForSequenceClassification.from_pretrained(path)`` loads it with the trained head.
    A ``tokenizer`` given is saved beside the weights (``save_pretrained``), in the same atomic
    write, so the directory serves on its own (vLLM, transformers).
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
    """The transformers classifier a critic / reward model exports as (:func:`classifier_target`)."""

    config: Any  # the body's config with num_labels=1 and the classifier's architectures
    base_prefix: str  # the attribute holding the body in that class ("model" for Llama/Qwen2)
    head_name: str  # its Linear(H, 1) head ("score")
    task_type: str  # PEFT's task type: "TOKEN_CLS" or "SEQ_CLS"
    state_keys: frozenset[str]  # the classifier's state-dict keys


def classifier_target(value_model: ValueModel) -> ClassifierTarget:
    """The transformers classifier a critic (``sequence_level=False``) or a reward model
    (``sequence_level=True``) exports as.

    A critic maps to ``AutoModelForTokenClassification``: its logits ``[b, L, 1]`` are the values
    at each *predicting* position (the engine's token-aligned ``values[b, t]`` is
    ``logits[b, t - 1]``); the config gets ``classifier_dropout=0.0`` (the engine trains without
    dropout) and ``token_classification_bias`` to match the head. A reward model maps to
    ``AutoModelForSequenceClassification``, which pools the logits at the last token that is not
    ``config.pad_token_id`` (transformers' rule; with no pad token it takes the last column and
    accepts one row at a time).

    Raises ``ValueError`` when the architecture has no such class, or when that class's head is
    not a single ``Linear(H, 1)`` with the trained head's bias: the export would otherwise load
    with a head that is not the trained one.
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
    """The state dict of ``target``'s classifier from ``value_model``'s full ``state`` (keys
    relative to it: ``body.*``, ``value_head.*``), LoRA merged into the body.

    Raises ``ValueError`` when the keys are not exactly the classifier's (e.g. a buffer it
    stores differently): never a model that loads with missing or random weights.
    """
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
    """:func:`export_peft_adapter` of a critic / reward model: the body's LoRA adapter plus the
    trained head as a module to save, for the classifier of :func:`classifier_target`::

        base = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=1)
        model = PeftModel.from_pretrained(base, path)   # adapters + the trained ``score``

    (``AutoModelForTokenClassification`` for a critic.) The adapter config is the training one
    with ``task_type`` set and ``modules_to_save=[head_name]``.
    """
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
