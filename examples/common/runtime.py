"""The plumbing every example shares: command line, output directory, processes, Ctrl-C, and
run checkpoints.

- :func:`parse_cli`: ``--config``, ``--resume``, ``--overwrite`` and positional ``key.sub=value``
  overrides, loaded into the example's typed config (``--help`` lists every key with its default
  and a one-line description). A run never silently replaces another: an ``output.dir`` holding a
  checkpoint needs ``--resume`` (continue it, from its saved config plus the overrides given) or
  ``--overwrite`` (delete its outputs and start again).
- :func:`prepare_output`: after the processes have started, rank 0 restores a checkpoint an
  interrupted swap left aside (``--resume``) or deletes the previous run's outputs
  (``--overwrite``).
- :class:`Dist`: rank and world size, the same code under ``python`` and ``torchrun``.
- :class:`StopOnInterrupt`: Ctrl-C asks the loop to stop at the next step boundary, the same step on
  every rank, so the checkpoint written then is consistent; a second Ctrl-C aborts at once.
- :func:`save_run` / :func:`load_run`: the engines' checkpoints plus the loop's own state (step,
  Python and torch RNG of each rank) and the config, swapped in atomically
  (:func:`microrl.engine.atomic_io.replace_dir`; killed at any point, a complete copy survives).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import microrl.configs
from microrl.configs.examples import EXTERNAL_HELP
from microrl.configs.loader import (
    config_changes,
    config_to_yaml,
    describe_config,
    load_config,
    override_value,
)
from microrl.engine.atomic_io import (
    fsync_dir,
    recover_swap,
    replace_dir,
    staging_paths,
    write_json,
)

__all__ = [
    "Dist",
    "StopOnInterrupt",
    "find_run_checkpoint",
    "load_run",
    "parse_cli",
    "per_rank",
    "prepare_output",
    "save_run",
]

T = TypeVar("T")
CONFIG_DIR = Path(microrl.configs.__file__).resolve().parent
CHECKPOINT_DIR = "checkpoint"
RUN_MARKER = "run.json"  # written last into a run checkpoint: its completion marker
SAVED_CONFIG = "config.yaml"
RUN_FORMAT = "microrl-example-run"
# What a run writes into output.dir: what --overwrite deletes (and nothing else there).
RUN_OUTPUTS = (
    CHECKPOINT_DIR,
    "adapter",
    "tensorboard",
    "metrics.jsonl",
    "curves.png",
    "config.yaml",
)
# Names of the swap directories before they were hidden (.checkpoint.old): still recovered.
_LEGACY_STAGING = (f"{CHECKPOINT_DIR}.tmp", f"{CHECKPOINT_DIR}.old")
_HELP_WIDTH = 44  # column of the descriptions in --help


def _help_epilog(defaults: Any, source: str) -> str:
    lines = [f"config keys (override as key.sub=value), with the defaults of {source}:"]
    for key, value, help_text in describe_config(defaults, EXTERNAL_HELP):
        entry = f"  {key}={value}"
        lines.append(f"{entry.ljust(_HELP_WIDTH)}  {help_text}")
    return "\n".join(lines)


def _line_buffered_stdout() -> None:
    """Cluster logs (stdout a file or a pipe) get each line when it is printed, not in blocks."""
    if not sys.stdout.isatty():
        with contextlib.suppress(AttributeError, ValueError, OSError):
            sys.stdout.reconfigure(line_buffering=True)


def parse_cli(
    schema: type[T], config_name: str, description: str, argv: Sequence[str] | None = None
) -> tuple[T, argparse.Namespace]:
    """Parse the command line into ``(config, args)``; bad keys or values exit with the message.

    Without ``--resume`` the config is ``--config`` (default: ``configs/<config_name>``) plus the
    overrides, and an ``output.dir`` that holds a checkpoint is refused unless ``--overwrite`` is
    given. With ``--resume`` it is the run's saved ``<output.dir>/checkpoint/config.yaml`` plus
    the overrides given now (``args.resume_changes`` lists the keys they change). Only reads the
    file system: what has to change there happens in :func:`prepare_output`, once every process
    has started. Under ``torchrun`` every rank decides alike and only rank 0 prints an error.
    """
    default_path = CONFIG_DIR / config_name
    defaults = load_config(schema, default_path)
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_help_epilog(defaults, default_path.name),
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="override a config value"
    )
    parser.add_argument(
        "--config", default=None, help=f"YAML config (default: {default_path}; not with --resume)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help=f"continue the run in output.dir from <output.dir>/{CHECKPOINT_DIR} (saved at the "
        "end, every output.save_every steps, and on Ctrl-C), with its saved config; the "
        "key.sub=value overrides given change it (e.g. a larger train.steps)",
    )
    mode.add_argument(
        "--overwrite",
        action="store_true",
        help="start again in an output.dir that holds a previous run: delete its outputs "
        f"({', '.join(RUN_OUTPUTS)}) first",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    args = parser.parse_args(argv)
    # The examples print their own progress; transformers' per-file load/save bars are noise here.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _line_buffered_stdout()
    args.resume_changes = []
    try:
        if args.resume:
            if args.config is not None:
                raise ValueError(
                    "--resume continues from the run's saved config: give changes as "
                    "key.sub=value overrides, not --config"
                )
            config, args.resume_changes = _resume_config(schema, defaults, args.overrides)
        else:
            config = load_config(schema, args.config or default_path, args.overrides)
            if not (args.overwrite or args.print_config):
                _refuse_previous_run(config.output.dir)
    except ValueError as err:
        if _env_rank() != 0:  # every rank reached the same verdict; one prints it
            raise SystemExit(2) from None
        parser.error(str(err))
    if args.print_config:
        print(config_to_yaml(config), end="")
        raise SystemExit(0)
    return config, args


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


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
    for candidate in (old, Path(out_dir) / _LEGACY_STAGING[1]):
        if candidate.is_dir():
            return candidate
    return None


def _recover_run_checkpoint(out_dir: str | Path) -> None:
    final = Path(out_dir) / CHECKPOINT_DIR
    recover_swap(final, _is_complete_run)
    legacy_old = Path(out_dir) / _LEGACY_STAGING[1]  # the swap of earlier versions
    if not final.exists() and legacy_old.is_dir():
        legacy_old.rename(final)


def _refuse_previous_run(out_dir: str) -> None:
    found = find_run_checkpoint(out_dir)
    if found is not None:
        raise ValueError(
            f"output.dir={out_dir} holds a previous run's checkpoint ({found}); pass --resume "
            "to continue it, --overwrite to delete its outputs and start again, or choose "
            "another output.dir="
        )


def _resume_config(
    schema: type[T], defaults: Any, overrides: Sequence[str]
) -> tuple[T, list[tuple[str, str, str]]]:
    out_dir = str(override_value(overrides, "output.dir", defaults.output.dir))
    found = find_run_checkpoint(out_dir)
    if found is None:
        raise ValueError(
            f"--resume: output.dir={out_dir} holds no checkpoint ({Path(out_dir) / CHECKPOINT_DIR} "
            "does not exist); start without --resume"
        )
    saved_path = found / SAVED_CONFIG
    saved = load_config(schema, saved_path)
    config = load_config(schema, saved_path, overrides)
    config.output.dir = out_dir  # where it was found, should the run have been moved
    return config, config_changes(saved, config)


def prepare_output(config: Any, args: argparse.Namespace, dist_info: Dist) -> None:
    """Make ``output.dir`` ready for the run; every rank calls it after :meth:`Dist.init`.

    Rank 0 restores a checkpoint an interrupted swap left aside (every run), prints what
    ``--resume`` changes in the saved config, and with ``--overwrite`` deletes the previous run's
    outputs, only the names a run writes (:data:`RUN_OUTPUTS` and their swap leftovers). Deleting
    them at the start, rather than when the new run first saves, keeps a directory from ever
    mixing the two runs (a later ``--resume`` would continue the old checkpoint with the new
    metrics); ``--overwrite`` is the explicit request for it.
    """
    if dist_info.is_main:
        out = Path(config.output.dir)
        if args.overwrite:
            removed = []
            for name in RUN_OUTPUTS + _LEGACY_STAGING:
                for path in (out / name, *staging_paths(out / name)):
                    if path.is_dir():
                        shutil.rmtree(path)
                    elif path.exists():
                        path.unlink()
                    else:
                        continue
                    removed.append(path.name)
            if removed:
                print(f"--overwrite: deleted the previous run's {', '.join(removed)} in {out}")
        else:
            _recover_run_checkpoint(out)
        if args.resume:
            changes = args.resume_changes
            changed = ", ".join(f"{k} {old} -> {new}" for k, old, new in changes)
            print(
                f"resuming {out / CHECKPOINT_DIR} with its saved config; "
                + (f"changed by the command line: {changed}" if changes else "no key changed")
            )
    dist_info.barrier()


def per_rank(total: int, key: str, dist_info: Dist) -> int:
    """``total`` split evenly over the ranks (a ``ValueError`` naming ``key`` when it does not)."""
    if total % dist_info.world_size:
        raise ValueError(
            f"{key}={total} must be divisible by the number of processes ({dist_info.world_size})"
        )
    return total // dist_info.world_size


@dataclass(frozen=True)
class Dist:
    """This process's place among the data-parallel ranks (1 rank under plain ``python``)."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def init(cls) -> Dist:
        """Join the process group when launched by ``torchrun`` (gloo on CPU, nccl on GPU)."""
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous slice of ``items`` (sizes differ by at most 1)."""
        n = len(items)
        start = self.rank * n // self.world_size
        stop = (self.rank + 1) * n // self.world_size
        return list(items[start:stop])

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor.tolist()

    def any(self, flag: bool) -> bool:
        return self.sum([float(flag)])[0] > 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class StopOnInterrupt:
    """Context manager turning the first SIGINT (Ctrl-C) into a polite stop request.

    The loop calls :meth:`should_stop` at each step boundary; under ``torchrun`` the flag is
    OR-reduced over ranks, so every rank stops after the same step and saves together.
    """

    def __init__(self, dist_info: Dist) -> None:
        self.dist = dist_info
        self.requested = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)  # a second Ctrl-C aborts immediately

    def __enter__(self) -> StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def should_stop(self) -> bool:
        return self.dist.any(self.requested)


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
) -> Path:
    """Write ``<out_dir>/checkpoint``: each engine's checkpoint, the loop state, the config.

    Everything goes to ``.checkpoint.tmp`` first, ``run.json`` last (the completion marker), and
    replaces the previous checkpoint by the swap of :func:`~microrl.engine.atomic_io.replace_dir`:
    a process killed at any point leaves the previous checkpoint or the new one, never neither;
    the next save or ``--resume`` puts the newest complete one in place.
    """
    final = Path(out_dir) / CHECKPOINT_DIR
    tmp, old = staging_paths(final)
    if dist_info.is_main:
        _recover_run_checkpoint(out_dir)
        shutil.rmtree(tmp, ignore_errors=True)  # an interrupted save's: never the only copy
        tmp.mkdir(parents=True)
    dist_info.barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(tmp / name)
    state = {
        "step": step,
        "python_rng": _to_lists(rng.getstate()),
        "torch_rng": torch.get_rng_state(),
    }
    state_path = _rank_state_path(tmp, dist_info.rank)
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
    out_dir: str | Path, engines: Mapping[str, Any], *, rng: random.Random, dist_info: Dist
) -> int:
    """Restore what :func:`save_run` wrote; returns the step to continue after."""
    if dist_info.is_main:
        _recover_run_checkpoint(out_dir)
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
    state_path = _rank_state_path(directory, dist_info.rank)
    if not state_path.is_file():
        raise FileNotFoundError(
            f"--resume: no checkpoint for rank {dist_info.rank} in {directory} "
            "(was it written with the same number of processes?)"
        )
    for name, engine in engines.items():
        engine.load_checkpoint(directory / name)  # the resumed config's lr etc. take effect
    state = torch.load(state_path, weights_only=True)
    rng.setstate(_to_tuples(state["python_rng"]))
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value
