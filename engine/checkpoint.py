"""Checkpoints that resume exactly, on 1 or N ranks, written atomically, loaded without pickle.

Layout of a checkpoint directory::

    manifest.json            written last: the completion marker, plus step, world size, tensor
                             names/shapes/dtypes, file sizes, optimizer hyper-parameters, scheduler
    config.json              the engine config (JSON, for people and for the mismatch check)
    state/*.safetensors      model (trainable parameters only, by default) and optimizer tensors,
                             one file per rank, written by torch.distributed.checkpoint (DCP)
    rng/rank_00000.json      each rank's python / numpy / torch / CUDA RNG states

Sharded tensors go through DCP with its safetensors storage, so a checkpoint saved on N ranks loads
on M ranks (DCP reshards) and nothing is unpickled: DCP's default ``.metadata`` file is a pickle,
the safetensors reader rebuilds the metadata from the files' JSON headers instead. Everything that
is not a tensor is JSON.

Atomicity: all ranks write into ``.<name>.tmp`` next to the target; after a barrier rank 0 writes
the manifest, fsyncs, and renames the temporary directory into place (the previous checkpoint is
moved aside first and deleted only after the rename). An error or crash before the rename leaves
the previous checkpoint untouched; a directory without a valid manifest is refused on load.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "is_complete_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
]

FORMAT = "microrl-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
CONFIG = "config.json"
STATE_DIR = "state"
RNG_DIR = "rng"
# Config sections that change the set or shapes of saved tensors: a difference is an error. Any
# other difference (a new learning rate, more total steps) is allowed and reported as a warning.
_STRUCTURAL_CONFIG_KEYS = ("lora",)
_MAX_LISTED = 8  # names shown in a mismatch error before "... and N more"


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupt, or does not match what loads it."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    world_size: int
    config: dict[str, Any] | None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it 'assumes' a single process even when told so with ``no_dist``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples, paths -> plain JSON values; anything else is a ``TypeError``."""
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, Enum):
        return to_jsonable(value.value)
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint's JSON: {value!r}")


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_and_old(path: Path) -> tuple[Path, Path]:
    return path.parent / f".{path.name}.tmp", path.parent / f".{path.name}.old"


# ----------------------------------------------------------------------------- state dicts


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool):
    """(tensors for DCP, JSON part of the optimizer state, {fqn: (shape, dtype)} of the model)."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model_sd, optim_sd = get_model_state_dict(model, options=options), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    model_sd, aliases = _drop_aliases(model_sd)
    tensors: dict[str, Any] = {"model": model_sd}
    optim_json: dict[str, Any] | None = None
    if optim_sd is not None:
        tensor_state: dict[str, dict[str, torch.Tensor]] = {}
        scalar_state: dict[str, dict[str, Any]] = {}
        for fqn, entry in optim_sd["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensor_state.setdefault(fqn, {})[key] = value
                else:
                    scalar_state.setdefault(fqn, {})[key] = to_jsonable(value)
        tensors["optim"] = tensor_state
        optim_json = {
            "class": type(optimizer).__name__,
            "param_groups": to_jsonable(optim_sd["param_groups"]),
            "scalar_state": scalar_state,
        }
    return tensors, optim_json, aliases


def _drop_aliases(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Keep one name per storage (tied embeddings): safetensors refuses shared tensors.

    Returns the de-duplicated state and ``{alias: kept name}``; loading the kept name fills the
    alias too, since both are the same parameter.
    """
    seen: dict[tuple, str] = {}
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = value
    return kept, aliases


def _flat_tensor_specs(tensors: Mapping[str, Any], prefix: str = "") -> dict[str, list]:
    out: dict[str, list] = {}
    for key, value in tensors.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat_tensor_specs(value, name + "."))
        else:
            out[name] = [list(value.shape), str(value.dtype).removeprefix("torch.")]
    return out


# ----------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(mt), gauss]}
    if "numpy" in sys.modules:  # only when the program uses numpy; never import it for this
        np_state = sys.modules["numpy"].random.get_state()
        state["numpy"] = [np_state[0], np_state[1].tolist(), *np_state[2:]]
    state["torch"] = torch.get_rng_state().tolist()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    if "numpy" in state:
        np = sys.modules.get("numpy") or __import__("numpy")
        name, keys, *rest = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ----------------------------------------------------------------------------- save


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    step: int = 0,
    config: Any = None,
    rng: bool = True,
    trainable_only: bool = True,
) -> Path:
    """Save everything a resume needs into ``path``, atomically; every rank must call it.

    Args:
        path: the checkpoint directory; an existing checkpoint there is replaced only once the new
            one is complete.
        model: the trained module (sharded with FSDP2 or not).
        optimizer, scheduler: their states (the scheduler's ``state_dict`` must be JSON-able,
            as ``LambdaLR`` / ``LinearLR`` / ... with function lambdas are).
        step: the optimizer-step counter to resume from.
        config: a dataclass or mapping, stored as JSON and checked on load.
        rng: save each rank's RNG states.
        trainable_only: save only parameters with ``requires_grad`` (the adapter under LoRA; the
            frozen base comes from the base model on load).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    target = Path(path).absolute()
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        # Every rank checks (a shared filesystem gives them the same answer), so all fail alike.
        raise CheckpointError(
            f"refusing to replace {target}: it is a non-empty directory that is not a microrl "
            "checkpoint"
        )
    tmp, old = _tmp_and_old(target)
    rank, world = _rank(), _world()
    config_json = to_jsonable(config) if config is not None else None
    sched_json = to_jsonable(scheduler.state_dict()) if scheduler is not None else None
    tensors, optim_json, aliases = _state(model, optimizer, trainable_only)
    if rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        (tmp / STATE_DIR).mkdir(parents=True)
        (tmp / RNG_DIR).mkdir()
    _barrier()
    try:
        writer = HuggingFaceStorageWriter(str(tmp / STATE_DIR), save_distributed=True)
        with _quiet_single_process():
            dcp.save(tensors, storage_writer=writer, no_dist=world == 1)
        if rng:
            _write_json(tmp / RNG_DIR / f"rank_{rank:05d}.json", _rng_state())
        _barrier()
        if rank == 0:
            _write_json(tmp / CONFIG, config_json)
            files = {
                str(p.relative_to(tmp)): p.stat().st_size
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "step": step,
                "world_size": world,
                "trainable_only": trainable_only,
                "rng": rng,
                "tensors": _flat_tensor_specs(tensors),
                "aliases": aliases,
                "optimizer": optim_json,
                "scheduler": sched_json,
                "files": files,
            }
            _write_json(tmp / MANIFEST, manifest)  # the completion marker: written last
            for sub in (tmp / STATE_DIR, tmp / RNG_DIR, tmp):
                _fsync_dir(sub)
            _replace_dir(tmp, target, old)
    except BaseException:
        if world == 1:  # with several ranks the others may still write into it
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return target


def _replace_dir(tmp: Path, target: Path, old: Path) -> None:
    """Move ``tmp`` to ``target``; a previous ``target`` survives until the new one is in place."""
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- load


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; ``CheckpointError`` for anything else."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not root.is_dir():
        _, old = _tmp_and_old(root.absolute())
        hint = f" (a previous checkpoint was moved aside to {old})" if old.is_dir() else ""
        raise CheckpointError(f"checkpoint directory {root} does not exist{hint}")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{root} is not a complete microrl checkpoint: {MANIFEST} is missing "
            "(an interrupted save, or not a checkpoint directory)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{manifest_path} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a microrl checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{root}: checkpoint format version {manifest.get('version')} is not supported "
            f"(this microrl reads version {VERSION})"
        )
    for name, size in manifest["files"].items():
        file = root / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(
                f"{root} is incomplete or corrupt: {name} is missing or has the wrong size"
            )
    return manifest


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _check_tensors(saved: Mapping[str, list], expected: Mapping[str, list], root: Path) -> None:
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    reshaped = sorted(
        f"{k} (checkpoint {saved[k][0]} {saved[k][1]}, model {expected[k][0]} {expected[k][1]})"
        for k in set(saved) & set(expected)
        if list(saved[k][0]) != list(expected[k][0]) or saved[k][1] != expected[k][1]
    )
    problems = []
    if missing:
        problems.append(f"not in the checkpoint: {_listed(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model/optimizer: {_listed(unexpected)}")
    if reshaped:
        problems.append(f"shape/dtype differs: {_listed(reshaped)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {root} does not match the model being loaded "
            "(different architecture, LoRA rank/targets, trainable set or optimizer?): "
            + "; ".join(problems)
        )


def _config_diff(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            name = f"{prefix}{key}"
            if key not in saved or key not in current:
                out.append(name)
            else:
                out.extend(_config_diff(saved[key], current[key], name + "."))
        return out
    return [] if saved == current else [f"{prefix.rstrip('.')} ({saved!r} -> {current!r})"]


def _check_config(saved: Any, config: Any, root: Path) -> None:
    if saved is None or config is None:
        return
    diffs = _config_diff(saved, to_jsonable(config))
    structural = [
        d for d in diffs if d.split(".", 1)[0].split(" ", 1)[0] in _STRUCTURAL_CONFIG_KEYS
    ]
    if structural:
        raise CheckpointError(
            f"checkpoint {root} was saved with a different model structure: {_listed(structural)}"
        )
    if diffs:
        warnings.warn(f"resuming {root} with a changed config: {_listed(diffs)}", stacklevel=3)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    config: Any = None,
    rng: bool = True,
) -> CheckpointInfo:
    """Restore a :func:`save_checkpoint` directory into ``model`` (and optimizer, scheduler, RNG).

    Every rank must call it. The model and optimizer must be built as for the save (same
    architecture, LoRA config, sharding may differ). Raises :class:`CheckpointError` naming what
    differs before anything is modified. RNG states are restored only when the world size equals
    the saving one (per-rank streams cannot be mapped to a different number of ranks).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    root = Path(path).absolute()
    manifest = read_manifest(root)
    saved_config = _read_config(root)
    _check_config(saved_config, config, root)
    if optimizer is not None and manifest["optimizer"] is None:
        raise CheckpointError(f"checkpoint {root} holds no optimizer state")
    saved_opt = manifest["optimizer"]
    if optimizer is not None and saved_opt["class"] != type(optimizer).__name__:
        raise CheckpointError(
            f"checkpoint {root} holds {saved_opt['class']} state, the optimizer is "
            f"{type(optimizer).__name__}"
        )
    tensors, _, aliases = _state(model, optimizer, manifest["trainable_only"])
    if aliases != manifest["aliases"]:
        raise CheckpointError(
            f"checkpoint {root} ties parameters {manifest['aliases']}, the model {aliases} "
            "(tie_word_embeddings differs?)"
        )
    saved_specs = manifest["tensors"]
    if optimizer is None:
        saved_specs = {k: v for k, v in saved_specs.items() if not k.startswith("optim.")}
    _check_tensors(saved_specs, _flat_tensor_specs(tensors), root)
    if scheduler is not None and manifest["scheduler"] is None:
        raise CheckpointError(f"checkpoint {root} holds no LR scheduler state")

    with _quiet_single_process():
        dcp.load(
            tensors,
            storage_reader=HuggingFaceStorageReader(str(root / STATE_DIR)),
            no_dist=_world() == 1,
        )
    options = StateDictOptions(ignore_frozen_params=manifest["trainable_only"], strict=False)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        result = set_model_state_dict(model, tensors["model"], options=options)
    else:
        optim_sd = _optimizer_state_dict(tensors["optim"], saved_opt, optimizer, root)
        result = set_state_dict(
            model,
            optimizer,
            model_state_dict=tensors["model"],
            optim_state_dict=optim_sd,
            options=options,
        )
    if result.unexpected_keys:
        raise CheckpointError(f"unexpected keys loading {root}: {_listed(result.unexpected_keys)}")
    if scheduler is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    if rng and manifest["rng"]:
        if manifest["world_size"] == _world():
            state = json.loads((root / RNG_DIR / f"rank_{_rank():05d}.json").read_text())
            _set_rng_state(state)
        elif _rank() == 0:
            warnings.warn(
                f"{root} was saved on {manifest['world_size']} ranks and loads on {_world()}: "
                "RNG states not restored",
                stacklevel=2,
            )
    _barrier()
    return CheckpointInfo(root, manifest["step"], manifest["world_size"], saved_config)


def _read_config(root: Path) -> Any:
    return json.loads((root / CONFIG).read_text())


def _optimizer_state_dict(
    tensor_state: Mapping[str, Mapping[str, torch.Tensor]],
    saved: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    root: Path,
) -> dict[str, Any]:
    """Rebuild the FQN-keyed optimizer state dict from the loaded tensors and the JSON part."""
    state = {fqn: dict(entry) for fqn, entry in tensor_state.items()}
    for fqn, entry in saved["scalar_state"].items():
        state.setdefault(fqn, {}).update(entry)
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {root} has {len(groups)} optimizer param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    restored = []
    for group, live in zip(groups, optimizer.param_groups, strict=True):
        # JSON turned tuples (Adam's betas) into lists: give each value its live type back.
        restored.append(
            {
                k: tuple(v) if isinstance(live.get(k), tuple) and isinstance(v, list) else v
                for k, v in group.items()
            }
        )
    return {"state": state, "param_groups": restored}
