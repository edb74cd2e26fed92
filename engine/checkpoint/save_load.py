"""Checkpoints that resume exactly, on 1 or N ranks, written atomically, loaded without pickle.

Sharded tensors go through DCP with its safetensors storage (saved on N ranks, loadable on M;
the reader rebuilds DCP's metadata from the JSON headers); the rest is JSON. Rank 0 swaps
``.<name>.tmp`` into place once every rank agreed, so a crash never replaces a good checkpoint.
Layout and exact resume: docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_state_dict,
)

from microrl.engine.checkpoint.agreement import (
    CheckpointAbortedError,
    RankSync,
    phase,
    resolve_timeout,
)
from microrl.engine.checkpoint.atomic_io import (
    fsync_dir,
    recover_swap,
    refuse_foreign_dir,
    replace_dir,
    staging_paths,
    to_jsonable,
    write_json,
)
from microrl.engine.checkpoint.rng import rng_state, set_rng_state
from microrl.engine.checkpoint.state_dicts import join_optimizer_state, split_state, tensor_specs
from microrl.engine.parallel import distributed

__all__ = [
    "CheckpointAbortedError",
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
# Config sections that change the saved tensors: a difference is an error, any other a warning.
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


@contextlib.contextmanager
def _dcp_call(rank: int) -> Iterator[None]:
    """Around a DCP save or load: this rank's own error raised as itself (DCP wraps it in a
    ``CheckpointException`` that ``except Exception`` misses and that names only ranks), without
    DCP's ``no_dist`` warning; another rank's failure stays DCP's (the agreement names it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as err:
            own = err.failures.get(rank)
            if own is None:
                raise
            raise own[0] from None


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
    timeout_s: float | None = None,
) -> Path:
    """Save everything a resume needs into ``path``, atomically; every rank must call it.

    Args:
        path: the checkpoint directory; one already there is replaced once the new one is complete.
        model: the trained module (sharded with FSDP2 or not).
        optimizer, scheduler: their states (the scheduler's ``state_dict`` must be JSON-able).
        step: the optimizer-step counter to resume from.
        config: a dataclass or mapping, stored as JSON and checked on load.
        rng: save each rank's RNG states.
        trainable_only: only ``requires_grad`` parameters (the base comes from the base model).
        timeout_s: with several ranks, how long a rank waits for the others at each step before
            naming the missing ones (default ``$MICRORL_CHECKPOINT_TIMEOUT_S``, else 600).

    Raises:
        CheckpointAbortedError: on a rank whose part succeeded when another's failed (named in
            ``failed_ranks``); ``path`` keeps the previous checkpoint (docs/checkpoints.md).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    timeout_s = resolve_timeout(timeout_s)
    target = Path(path).absolute()
    tmp, old = staging_paths(target)
    rank, world = distributed.rank(), distributed.world_size()
    sync = RankSync(f"checkpoint save of {target}", timeout_s) if world > 1 else None
    try:
        with phase(sync, "prepare"):
            # Every rank checks (a shared filesystem gives them the same answer).
            recover_swap(target, _has_manifest)  # finish a swap a killed save left behind
            refuse_foreign_dir(target, _has_manifest, "a microrl checkpoint", CheckpointError)
            config_json = to_jsonable(config) if config is not None else None
            sched_json = to_jsonable(scheduler.state_dict()) if scheduler is not None else None
            tensors, optim_json, aliases = split_state(model, optimizer, trainable_only)
            if rank == 0:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
                (tmp / STATE_DIR).mkdir(parents=True)
                (tmp / RNG_DIR).mkdir()
        with phase(sync, "write"):
            writer = HuggingFaceStorageWriter(str(tmp / STATE_DIR), save_distributed=True)
            with _dcp_call(rank):
                dcp.save(
                    tensors,
                    storage_writer=writer,
                    no_dist=world == 1,
                    process_group=sync.group if sync is not None else None,
                )
            if rng:
                write_json(tmp / RNG_DIR / f"rank_{rank:05d}.json", rng_state())
        with phase(sync, "finalise"):
            if rank == 0:
                write_json(tmp / CONFIG, config_json)
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
                    "tensors": tensor_specs(tensors),
                    "aliases": aliases,
                    "optimizer": optim_json,
                    "scheduler": sched_json,
                    "files": files,
                }
                write_json(tmp / MANIFEST, manifest)  # the completion marker: written last
                for sub in (tmp / STATE_DIR, tmp / RNG_DIR, tmp):
                    fsync_dir(sub)
                replace_dir(tmp, target, old)
    except BaseException:
        # Every exception leaves an agreement: the live ranks have stopped writing.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _has_manifest(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; ``CheckpointError`` for anything else."""
    root = Path(path)
    recover_swap(root.absolute(), _has_manifest)  # a save killed between its two renames
    manifest_path = root / MANIFEST
    if not root.is_dir():
        _, old = staging_paths(root.absolute())
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
    """Whether ``path`` holds a finished checkpoint (its manifest, written last, reads back)."""
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
    timeout_s: float | None = None,
    local: bool = False,
) -> CheckpointInfo:
    """Restore a :func:`save_checkpoint` directory into ``model`` (and optimizer, scheduler, RNG).

    Every rank must call it, with model and optimizer built as for the save (sharding may differ).
    Raises :class:`CheckpointError` naming what differs before any parameter is modified; a
    failure on one rank fails all. RNG states are restored only at the saving world size.
    ``local``: this process alone loads into an unsharded ``model`` (no collectives, no RNG; e.g.
    each rank's frozen reward model).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    timeout_s = resolve_timeout(timeout_s)
    root = Path(path).absolute()
    world = 1 if local else distributed.world_size()
    sync = RankSync(f"checkpoint load of {root}", timeout_s) if world > 1 else None
    with phase(sync, "check"):
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
        tensors, _, aliases = split_state(model, optimizer, manifest["trainable_only"])
        if aliases != manifest["aliases"]:
            raise CheckpointError(
                f"checkpoint {root} ties parameters {manifest['aliases']}, the model {aliases} "
                "(tie_word_embeddings differs?)"
            )
        saved_specs = manifest["tensors"]
        if optimizer is None:
            saved_specs = {k: v for k, v in saved_specs.items() if not k.startswith("optim.")}
        _check_tensors(saved_specs, tensor_specs(tensors), root)
        if scheduler is not None and manifest["scheduler"] is None:
            raise CheckpointError(f"checkpoint {root} holds no LR scheduler state")
        if optimizer is not None and len(saved_opt["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(
                f"checkpoint {root} has {len(saved_opt['param_groups'])} optimizer param groups, "
                f"the optimizer {len(optimizer.param_groups)}"
            )
    # Every check passed on every rank: from here on model, optimizer and RNG are overwritten.
    with phase(sync, "restore"):
        with _dcp_call(0 if world == 1 else distributed.rank()):
            dcp.load(
                tensors,
                storage_reader=HuggingFaceStorageReader(str(root / STATE_DIR)),
                no_dist=world == 1,
                process_group=sync.group if sync is not None else None,
            )
        options = StateDictOptions(ignore_frozen_params=manifest["trainable_only"], strict=False)
        if optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            result = set_model_state_dict(model, tensors["model"], options=options)
        else:
            optim_sd = join_optimizer_state(tensors["optim"], saved_opt, optimizer)
            result = set_state_dict(
                model,
                optimizer,
                model_state_dict=tensors["model"],
                optim_state_dict=optim_sd,
                options=options,
            )
        if result.unexpected_keys:
            raise CheckpointError(
                f"unexpected keys loading {root}: {_listed(result.unexpected_keys)}"
            )
        if scheduler is not None:
            scheduler.load_state_dict(manifest["scheduler"])
        if rng and manifest["rng"] and not local:
            if manifest["world_size"] == distributed.world_size():
                state = json.loads(
                    (root / RNG_DIR / f"rank_{distributed.rank():05d}.json").read_text()
                )
                set_rng_state(state)
            elif distributed.rank() == 0:
                warnings.warn(
                    f"{root} was saved on {manifest['world_size']} ranks and loads on {distributed.world_size()}: "
                    "RNG states not restored",
                    stacklevel=2,
                )
    return CheckpointInfo(root, manifest["step"], manifest["world_size"], saved_config)


def _read_config(root: Path) -> Any:
    return json.loads((root / CONFIG).read_text())
