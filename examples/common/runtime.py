"""The plumbing every example shares: command line, processes, Ctrl-C, and run checkpoints.

- :func:`parse_cli`: ``--config``, ``--resume`` and positional ``key.sub=value`` overrides, loaded
  into the example's typed config (``--help`` lists every key with its default).
- :class:`Dist`: rank and world size, the same code under ``python`` and ``torchrun``.
- :class:`StopOnInterrupt`: Ctrl-C asks the loop to stop at the next step boundary, the same step on
  every rank, so the checkpoint written then is consistent; a second Ctrl-C aborts at once.
- :func:`save_run` / :func:`load_run`: the engines' checkpoints plus the loop's own state (step,
  Python and torch RNG of each rank), swapped in atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import microrl.configs
from microrl.configs.loader import config_to_yaml, load_config

__all__ = ["Dist", "StopOnInterrupt", "load_run", "parse_cli", "per_rank", "save_run"]

T = TypeVar("T")
CONFIG_DIR = Path(microrl.configs.__file__).resolve().parent
CHECKPOINT_DIR = "checkpoint"


def _flat_defaults(config: Any, prefix: str = "") -> list[str]:
    lines = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            lines += _flat_defaults(value, f"{prefix}{f.name}.")
        else:
            shown = getattr(value, "value", value)
            lines.append(f"  {prefix}{f.name}={shown}")
    return lines


def parse_cli(
    schema: type[T], config_name: str, description: str, argv: Sequence[str] | None = None
) -> tuple[T, argparse.Namespace]:
    """Parse the command line into ``(config, args)``; bad keys or values exit with the message."""
    default_path = CONFIG_DIR / config_name
    defaults = load_config(schema, default_path)
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (override as key.sub=value), with the defaults of "
        f"{default_path.name}:\n" + "\n".join(_flat_defaults(defaults)),
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="override a config value"
    )
    parser.add_argument(
        "--config", default=str(default_path), help="YAML config (default: %(default)s)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help=f"continue from <output.dir>/{CHECKPOINT_DIR} (saved at the end, every "
        "output.save_every steps, and on Ctrl-C)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    args = parser.parse_args(argv)
    # The examples print their own progress; transformers' per-file load/save bars are noise here.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        config = load_config(schema, args.config, args.overrides)
    except ValueError as err:
        parser.error(str(err))
    if args.print_config:
        print(config_to_yaml(config), end="")
        raise SystemExit(0)
    return config, args


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

    Everything goes to a temporary directory first and replaces the previous checkpoint by a
    rename at the end, so an interrupted save never leaves a half-written checkpoint behind.
    """
    final = Path(out_dir) / CHECKPOINT_DIR
    tmp = Path(out_dir) / f"{CHECKPOINT_DIR}.tmp"
    if dist_info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist_info.barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(tmp / name)
    state = {
        "step": step,
        "python_rng": _to_lists(rng.getstate()),
        "torch_rng": torch.get_rng_state(),
    }
    torch.save(state, _rank_state_path(tmp, dist_info.rank))
    dist_info.barrier()
    if dist_info.is_main:
        (tmp / "config.yaml").write_text(config_to_yaml(config))
        old = Path(out_dir) / f"{CHECKPOINT_DIR}.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    dist_info.barrier()
    return final


def load_run(
    out_dir: str | Path, engines: Mapping[str, Any], *, rng: random.Random, dist_info: Dist
) -> int:
    """Restore what :func:`save_run` wrote; returns the step to continue after."""
    directory = Path(out_dir) / CHECKPOINT_DIR
    state_path = _rank_state_path(directory, dist_info.rank)
    if not state_path.is_file():
        raise FileNotFoundError(
            f"--resume: no checkpoint for rank {dist_info.rank} in {directory} "
            "(was it written with the same number of processes?)"
        )
    for name, engine in engines.items():
        engine.load_checkpoint(directory / name)
    state = torch.load(state_path, weights_only=True)
    rng.setstate(_to_tuples(state["python_rng"]))
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


def _to_lists(value: Any) -> Any:
    return [_to_lists(v) for v in value] if isinstance(value, tuple) else value


def _to_tuples(value: Any) -> Any:
    return tuple(_to_tuples(v) for v in value) if isinstance(value, list) else value
