"""The fault suite's helpers (tests/faults/): runs stopped by an injected fault, their records,
a disk as a kill leaves it, and a worker-side factory that dies mid-message."""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path

import torch
from example_utils import load_example, load_recipe

from microrl.run import StepFailed, read_metrics, sample_rows

# Wall-clock figures: they differ between any two runs.
TIMINGS = ("tokens_per_s", "step_time", "staleness/take_wait_s")


class Killed(BaseException):
    """What stops a run in process where a kill would end it (no ``except Exception`` takes it)."""


def run(args: list[str], monkeypatch, recipe: str = "grpo_lora"):
    """Run ``recipe`` in process: the prompts of each step it trained, and how it ended (its
    exit code, or the :class:`~microrl.run.StepFailed` or :class:`Killed` that stopped it)."""
    module = load_example(recipe)
    trained: list[list[str]] = []

    def record(rollout, problems, scores, *rest):  # once per step, after its update
        trained.append([p.prompt for p in problems])
        return sample_rows(rollout, problems, scores, *rest)

    monkeypatch.setattr(load_recipe(recipe), "sample_rows", record)
    try:
        return trained, module.main(args)
    except (StepFailed, Killed) as err:
        return trained, err


def by_step(out: Path) -> dict[int, dict]:
    """The last metrics record of each step (a resumed run rewrites the steps after its
    checkpoint), without the wall-clock figures."""
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    return {s: {k: v for k, v in r.items() if k not in TIMINGS} for s, r in records.items()}


def checkpoint_step(out: Path) -> int:
    """The step of the run checkpoint in ``out`` (its rank-0 loop state)."""
    state = torch.load(out / "checkpoint" / "loop_state_rank0.pt", weights_only=True)
    return state["step"]


def as_killed(out: Path, copy: Path) -> None:
    """Copy ``out`` to ``copy`` as it is now: the disk a SIGKILL at this instant would leave."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(out, copy, symlinks=True)


def restore(copy: Path, out: Path) -> None:
    """Put the copy of :func:`as_killed` back in place of ``out``."""
    shutil.rmtree(out)
    shutil.copytree(copy, out, symlinks=True)


def kill_when(monkeypatch, owner, name: str, when, out: Path, copy: Path) -> None:
    """Replace ``owner.<name>`` by a function that, the first time ``when(*args)`` holds, copies
    ``out`` to ``copy`` as a kill at that instant leaves it (:func:`as_killed`) and raises
    :class:`Killed` instead of doing its work."""
    original = getattr(owner, name)
    killed = []

    def killing(*args, **kwargs):
        if not killed and when(*args):
            killed.append(name)
            as_killed(out, copy)
            raise Killed(f"killed before {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, killing)


def nth_call(n: int):
    """A ``when`` for :func:`kill_when` that holds at its ``n``-th call."""
    calls = itertools.count(1)
    return lambda *args: next(calls) == n


def dies_while_its_error_is_sent(problem):
    """An environment factory for the ``hf`` worker (picklable by reference) that kills the
    worker half a second from now and raises an error too big for a pipe's buffer: the worker
    dies in the middle of sending it, while the trainer reads nothing."""
    threading.Timer(0.5, os._exit, (9,)).start()
    raise RuntimeError("x" * (1 << 22))
