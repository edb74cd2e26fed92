"""Export a trained model for the ecosystem: a PEFT adapter, or a merged transformers model.

Both work on a plain or an FSDP2-sharded module: the full state dict is gathered to rank 0 on the
CPU first (``full_state_dict=True, cpu_offload=True``: one parameter at a time, so no rank ever
holds two full copies on the accelerator), then rank 0 writes. Every rank must call them.

* :func:`export_peft_adapter` writes what ``PeftModel.from_pretrained(base, path)`` loads.
* :func:`export_merged_model` writes what ``AutoModelForCausalLM.from_pretrained(path)`` loads:
  the base weights with each LoRA update ``W + scaling * B @ A`` folded in.

Writes are atomic like checkpoints (a temporary directory renamed into place).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from microrl.engine.agreement import rank_agreement
from microrl.engine.atomic_io import refuse_foreign_dir, replace_dir, staging_paths

__all__ = ["export_merged_model", "export_peft_adapter", "full_state_dict", "merged_state_dict"]

_PEFT_BASE_PREFIX = "base_model.model."  # where PeftModel keeps the wrapped transformers model


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of ``model`` on the CPU on rank 0 (``{}`` on the other ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {k: v.detach() for k, v in state.items()} if _rank() == 0 else {}


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
        if _rank() == 0:
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


def _locate_base(model: nn.Module) -> tuple[str, nn.Module]:
    """The outermost transformers ``PreTrainedModel`` inside ``model`` and its name prefix."""
    from transformers import PreTrainedModel

    found = _find(model, PreTrainedModel)
    if found is None:
        raise ValueError(f"{type(model).__name__} holds no transformers model to export")
    return found


def export_peft_adapter(
    model: nn.Module, path: str | os.PathLike, *, peft_model: nn.Module | None = None
) -> Path:
    """Write the LoRA adapter trained inside ``model`` in PEFT's format.

    Args:
        model: the trained module (e.g. ``engine.module``), sharded or not.
        path: output directory, loadable with ``PeftModel.from_pretrained(base, path)``.
        peft_model: the ``PeftModel`` that injected the adapters (``engine.peft_model``); found
            inside ``model`` when omitted.
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
    prefix, base = _locate_base(model)
    if base is not peft_model.get_base_model():
        raise ValueError("peft_model does not wrap the transformers model inside model")
    state = {
        _PEFT_BASE_PREFIX + k: v for k, v in _sub_state(full_state_dict(model), prefix).items()
    }

    def write(tmp: Path) -> None:
        peft_model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)

    return _write_atomically(path, write)


def merged_state_dict(base: nn.Module, state: dict[str, torch.Tensor]) -> dict:
    """Fold each LoRA update ``scaling * B @ A`` into its base weight (float64 sum).

    Args:
        base: the transformers model with LoRA layers injected by peft.
        state: its full state dict (keys relative to ``base``).

    Returns the state dict of the plain transformers model (no ``base_layer`` or ``lora_`` keys).
    Only plain ``lora.Linear`` layers with one active adapter are supported (what the engine
    builds); anything else is a ``ValueError`` rather than a silently wrong merge.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    merged = {k: v for k, v in state.items() if ".lora_" not in k}
    for name, module in base.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            raise ValueError(f"{name}: modules_to_save is not supported by the merged export")
        if not isinstance(module, LoraLayer):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if type(module) is not LoraLinear or len(adapters) != 1:
            raise ValueError(f"{name}: only plain LoRA Linear layers with one adapter can merge")
        adapter = adapters[0]
        if module.use_dora.get(adapter, False):
            raise ValueError(f"{name}: DoRA layers are not supported by the merged export")
        weight_key = f"{name}.base_layer.weight"
        a = state[f"{name}.lora_A.{adapter}.weight"].double()
        b = state[f"{name}.lora_B.{adapter}.weight"].double()
        delta = (b @ a) * module.scaling[adapter]
        if module.fan_in_fan_out:
            delta = delta.T
        weight = merged[weight_key]
        merged[weight_key] = (weight.double() + delta).to(weight.dtype)
    return {k.replace(".base_layer.", "."): v for k, v in merged.items()}


def export_merged_model(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the trained transformers model inside ``model`` in its own format, LoRA merged in.

    ``AutoModelForCausalLM.from_pretrained(path)`` loads it (for a critic: the decoder body,
    without the value head). Without LoRA it is the fine-tuned model itself; the weights keep
    their training dtype.
    """
    prefix, base = _locate_base(model)
    state = _sub_state(full_state_dict(model), prefix)
    if _rank() == 0:
        state = merged_state_dict(base, state)

    def write(tmp: Path) -> None:
        base.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)

    return _write_atomically(path, write)
