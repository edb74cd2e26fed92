"""Run checkpoints: every engine's checkpoint plus the loop's own state, swapped in atomically.

:func:`save_run` / :func:`load_run` write and restore the engines' checkpoints, the loop state (step,
Python and torch RNG of each rank) and the config, under ``<output.dir>/checkpoint``, swapped in by
:func:`microrl.engine.checkpoint.atomic_io.replace_dir`: killed at any point, a complete copy survives, and
:func:`find_run_checkpoint` / :func:`recover_run_checkpoint` find and restore it (docs/checkpoints.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from microrl.configs.loader import config_to_yaml
from microrl.engine.checkpoint.atomic_io import (
    fsync_dir,
    recover_swap,
    replace_dir,
    staging_paths,
    write_json,
)
from microrl.run.dist import Dist

__all__ = [
    "CHECKPOINT_DIR",
    "RUN_OUTPUTS",
    "VLLM_SERVER_LOGS",
    "find_run_checkpoint",
    "load_run",
    "recover_run_checkpoint",
    "save_run",
]

CHECKPOINT_DIR = "checkpoint"
RUN_MARKER = "run.json"  # written last into a run checkpoint: its completion marker
SAVED_CONFIG = "config.yaml"
RUN_FORMAT = "microrl-example-run"
# The local vLLM servers' logs (rollout.backend=vllm, max_staleness > 0), under output.dir.
VLLM_SERVER_LOGS = "vllm-servers"
# What a run writes into output.dir: what --overwrite deletes (and nothing else there).
RUN_OUTPUTS = (
    CHECKPOINT_DIR,
    "adapter",
    "model",  # a full fine-tune's trained model (actor.lora.rank=0)
    "merged",  # output.export_merged: the LoRA merged into the base model
    "tensorboard",
    "metrics.jsonl",
    "samples.jsonl",  # output.log_samples_every: sampled completions
    "curves.png",
    "config.yaml",
    "trackers.json",  # the W&B / MLflow run ids that --resume continues (not their local runs)
    VLLM_SERVER_LOGS,
)


def _is_complete_run(directory: Path) -> bool:
    return (directory / RUN_MARKER).is_file()


def find_run_checkpoint(out_dir: str | Path) -> Path | None:
    """The directory holding the run checkpoint of ``out_dir``, without changing anything:
    ``<out_dir>/checkpoint``, else what :func:`prepare_output` will put there after a swap that
    a killed process left half done: the new complete copy (``.checkpoint.tmp`` with its
    ``run.json``), else the previous one (``.checkpoint.old``); ``None`` when there is none."""
    final = Path(out_dir) / CHECKPOINT_DIR
    tmp, old = staging_paths(final)
    if final.is_dir():
        return final
    if tmp.is_dir() and _is_complete_run(tmp):
        return tmp
    return old if old.is_dir() else None


def recover_run_checkpoint(out_dir: str | Path) -> None:
    final = Path(out_dir) / CHECKPOINT_DIR
    recover_swap(final, _is_complete_run)


def _rank_state_path(directory: Path, rank: int) -> Path:
    return directory / f"loop_state_rank{rank}.pt"


def save_run(
    out_dir: str | Path,
    engines: Mapping[str, Any],
    *,
    step: int,
    rng: random.Random,
    dist_info: Dist,
    config: Any,
    extra_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``<out_dir>/checkpoint``: each engine's checkpoint, the loop state, the config.

    ``extra_state``: more of this rank's loop state, saved beside its RNG states and given back
    by :func:`load_run` (tensors, strings, numbers, lists and dicts of them: it is read with
    ``weights_only=True``), e.g. the rollouts an asynchronous run sampled ahead
    (:meth:`microrl.run.source.RolloutSource.state_dict`).

    Everything goes to ``.checkpoint.tmp`` first, ``run.json`` last (the completion marker), and
    replaces the previous checkpoint by the swap of :func:`~microrl.engine.checkpoint.atomic_io.replace_dir`:
    a process killed at any point leaves the previous checkpoint or the new one, never neither;
    the next save or ``--resume`` puts the newest complete one in place.
    """
    final = Path(out_dir) / CHECKPOINT_DIR
    tmp, old = staging_paths(final)
    if dist_info.is_main:
        recover_run_checkpoint(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted save's: never the only copy
        tmp.mkdir(parents=True)
    dist_info.barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(tmp / name)
    state = {
        "step": step,
        "python_rng": rng_state(rng),
        "torch_rng": torch.get_rng_state(),
    }
    if extra_state is not None:
        state["extra"] = dict(extra_state)
    state_path = _rank_state_path(tmp, dist_info.process)
    torch.save(state, state_path)
    _fsync_file(state_path)
    dist_info.barrier()
    if dist_info.is_main:
        (tmp / SAVED_CONFIG).write_text(config_to_yaml(config))
        _fsync_file(tmp / SAVED_CONFIG)
        marker = {
            "format": RUN_FORMAT,
            "step": step,
            "world_size": dist_info.world_size,
            "engines": list(engines),
        }
        write_json(tmp / RUN_MARKER, marker)
        fsync_dir(tmp)
        replace_dir(tmp, final, old)
    dist_info.barrier()
    return final


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def load_run(
    out_dir: str | Path,
    engines: Mapping[str, Any],
    *,
    rng: random.Random,
    dist_info: Dist,
    extra_state: dict[str, Any] | None = None,
) -> int:
    """Restore what :func:`save_run` wrote; returns the step to continue after.

    ``extra_state``: a dict that receives the ``extra_state`` this rank saved (nothing when it
    saved none)."""
    if dist_info.is_main:
        recover_run_checkpoint(out_dir)
    dist_info.barrier()
    directory = Path(out_dir) / CHECKPOINT_DIR
    marker_path = directory / RUN_MARKER
    if marker_path.is_file():  # (checkpoints of earlier versions have none)
        marker = json.loads(marker_path.read_text())
        if marker["world_size"] != dist_info.world_size:
            raise ValueError(
                f"--resume: {directory} was saved by {marker['world_size']} processes; resume "
                f"it with the same number (this run has {dist_info.world_size})"
            )
    state_path = _rank_state_path(directory, dist_info.process)
    if not state_path.is_file():
        raise FileNotFoundError(
            f"--resume: no checkpoint for rank {dist_info.process} in {directory} "
            "(was it written with the same number of processes?)"
        )
    for name, engine in engines.items():
        engine.load_checkpoint(directory / name)  # the resumed config's lr etc. take effect
    state = torch.load(state_path, weights_only=True)
    set_rng_state(rng, state["python_rng"])
    torch.set_rng_state(state["torch_rng"])
    if extra_state is not None:
        extra_state.update(state.get("extra", {}))
    return int(state["step"])


def rng_state(rng: random.Random) -> list:
    """``rng``'s state as nested lists (what ``torch.load(weights_only=True)`` reads back)."""
    return _to_lists(rng.getstate())


def set_rng_state(rng: random.Random, state: list) -> None:
    """Put ``rng`` back at a :func:`rng_state`."""
    rng.setstate(_to_tuples(state))


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value
