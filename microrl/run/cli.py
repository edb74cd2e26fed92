"""The command line of a training script: ``--config``, ``--resume``, ``--overwrite``, ``--debug``.

- :func:`parse_cli`: ``--config``, ``--resume``, ``--overwrite`` and positional ``key.sub=value``
  overrides, loaded into the script's typed config (``--help`` lists every key with its default
  and a one-line description). A run never silently replaces another: an ``output.dir`` holding a
  checkpoint needs ``--resume`` (continue it, from its saved config plus the overrides given) or
  ``--overwrite`` (delete its outputs and start again). A bad key or value, or a refused
  ``output.dir``, is one line on stderr (rank 0 under ``torchrun``) and exit code 2 on every rank;
  an error while the script runs is one line too (what failed, at which step), the traceback only
  with ``--debug``.
- :func:`prepare_output`: after the processes have started, rank 0 restores a checkpoint an
  interrupted swap left aside (``--resume``) or deletes the previous run's outputs
  (``--overwrite``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import microrl.configs
from microrl.configs.loader import (
    config_changes,
    config_to_yaml,
    describe_config,
    load_config,
    override_value,
)
from microrl.engine.checkpoint.atomic_io import staging_paths
from microrl.engine.parallel.nodes import check_shared_dir
from microrl.hub import first_line
from microrl.rollout.episodes import EpisodeError
from microrl.run.checkpoint import (
    CHECKPOINT_DIR,
    RUN_OUTPUTS,
    SAVED_CONFIG,
    find_run_checkpoint,
    recover_run_checkpoint,
)
from microrl.run.dist import Dist, StepFailed

__all__ = ["CONFIG_DIR", "PRESET_DIR", "config_file", "parse_cli", "prepare_output", "preset_names"]

T = TypeVar("T")
CONFIG_DIR = Path(microrl.configs.__file__).resolve().parent
#: The presets (configs/presets/*.yaml), installed with microrl: ``--config`` takes their names.
PRESET_DIR = CONFIG_DIR / "presets"
_HELP_WIDTH = 44  # column of the descriptions in --help


def _help_epilog(defaults: Any, source: str) -> str:
    lines = [f"config keys (override as key.sub=value), with the defaults of {source}:"]
    for key, value, help_text in describe_config(defaults):
        entry = f"  {key}={value}"
        lines.append(f"{entry.ljust(_HELP_WIDTH)}  {help_text}")
    return "\n".join(lines)


def preset_names() -> list[str]:
    """The names ``--config`` accepts besides a path: the presets' file names without
    ``.yaml``, sorted."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def config_file(value: str) -> Path:
    """``--config``'s YAML file: ``value`` when it is a file, else the preset it names
    (``qwen2.5-7b-instruct`` or ``qwen2.5-7b-instruct.yaml``), which a pip install has too;
    a ``ValueError`` listing the presets for anything else."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    name = value if value.endswith(".yaml") else f"{value}.yaml"
    if Path(name).name == name and (PRESET_DIR / name).is_file():
        return PRESET_DIR / name
    raise ValueError(
        f"--config {value!r} is neither a YAML file nor a preset name; the presets "
        f"(configs/presets/): {', '.join(preset_names())}"
    )


def _line_buffered_stdout() -> None:
    """Cluster logs (stdout a file or a pipe) get each line when it is printed, not in blocks."""
    if not sys.stdout.isatty():
        with contextlib.suppress(AttributeError, ValueError, OSError):
            sys.stdout.reconfigure(line_buffering=True)


def parse_cli(
    schema: type[T],
    config_name: str,
    description: str,
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
) -> tuple[T, argparse.Namespace]:
    """Parse the command line into ``(config, args)``; bad keys or values exit with the message.

    Without ``--resume`` the config is ``--config`` (a YAML file or a preset's name:
    :func:`config_file`; default: ``configs/<config_name>``) plus the overrides, and an ``output.dir`` that holds a checkpoint is refused unless ``--overwrite`` is
    given. With ``--resume`` it is the run's saved ``<output.dir>/checkpoint/config.yaml`` plus
    the overrides given now (``args.resume_changes`` lists the keys they change). Only reads the
    file system: what has to change there happens in :func:`prepare_output`, once every process
    has started. Under ``torchrun`` every rank decides alike and only rank 0 prints an error.
    ``prog``: the command's name in the usage and the errors (default: the script's file name).
    """
    default_path = CONFIG_DIR / config_name
    defaults = load_config(schema, default_path)
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_help_epilog(defaults, default_path.name),
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="override a config value"
    )
    parser.add_argument(
        "--config",
        default=None,
        help=f"YAML config, or a preset's name ({', '.join(preset_names())}; "
        f"configs/presets/) (default: {default_path}; not with --resume)",
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
    parser.add_argument(
        "--debug",
        action="store_true",
        help="an error prints its full traceback (default: one line, what failed and where)",
    )
    # Intermixed: overrides may come before and after the options (`output.dir=X --resume
    # train.steps=25`); plain parse_args stops the positionals at the first option.
    args = parser.parse_intermixed_args(argv)
    if not args.debug:
        sys.excepthook = _one_line_error
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
            path = default_path if args.config is None else config_file(args.config)
            config = load_config(schema, path, args.overrides)
            if not (args.overwrite or args.print_config):
                _refuse_previous_run(config.output.dir)
    except ValueError as err:
        # One line, without argparse's usage block (the key is named): every rank reached the
        # same verdict, and rank 0 prints it.
        if _env_rank() == 0:
            sys.stderr.write(f"{parser.prog}: error: {err}\n")
        raise SystemExit(2) from None
    if args.print_config:
        print(config_to_yaml(config), end="")
        raise SystemExit(0)
    return config, args


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _one_line_error(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    """``sys.excepthook`` of a script run without ``--debug``: an uncaught exception is one line
    on stderr (what failed, at which step, its message; the rank under ``torchrun``)."""
    if isinstance(exc, KeyboardInterrupt):
        line = "aborted by a second Ctrl-C: nothing saved after the last checkpoint"
    elif isinstance(exc, StepFailed) and isinstance(exc.error, EpisodeError):
        # The user's environment failed: its traceback is the part to read, so it is shown.
        line = f"error at step {exc.step}: {exc.error}\n"
    elif isinstance(exc, EpisodeError):  # in an evaluation
        line = f"error: {exc}\n"
    elif isinstance(exc, StepFailed):
        line = f"error at step {exc.step}: {first_line(exc.error)}"
    else:
        line = f"error: {first_line(exc)}"
    who = f"[rank {_env_rank()}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    sys.stderr.write(f"{who}{line} (--debug prints the traceback)\n")


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

    First, every rank checks that it sees the ``output.dir`` rank 0 sees (a ``ValueError`` on
    every rank otherwise): across nodes it must be on a shared file system, since every rank
    writes its share of the checkpoint there (docs/distributed.md#several-nodes).
    """
    check_shared_dir(config.output.dir, "output.dir")
    if dist_info.is_main:
        out = Path(config.output.dir)
        if args.overwrite:
            removed = []
            for name in RUN_OUTPUTS:
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
            recover_run_checkpoint(out)
        if args.resume:
            changes = args.resume_changes
            changed = ", ".join(f"{k} {old} -> {new}" for k, old, new in changes)
            print(
                f"resuming {out / CHECKPOINT_DIR} with its saved config; "
                + (f"changed by the command line: {changed}" if changes else "no key changed")
            )
    dist_info.barrier()
