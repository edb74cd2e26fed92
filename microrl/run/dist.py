"""This process's place among the ranks, and a Ctrl-C that stops every rank at the same step.

- :class:`Dist`: rank and world size, the same code under ``python`` and ``torchrun``, and the
  process group of the data ranks (:meth:`Dist.data_group`): the one rank abstraction the
  recipes use.
- :class:`StopOnInterrupt`: Ctrl-C asks the loop to stop at the next step boundary, the same step on
  every rank, so the checkpoint written then is consistent; a second Ctrl-C aborts at once. An
  exception raised in the loop leaves it as :class:`StepFailed`, naming the step.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from microrl.engine import setup
from microrl.engine.parallel import distributed

__all__ = ["Dist", "StepFailed", "StopOnInterrupt", "per_rank", "train_threads"]

STOP_MESSAGE = "stopping after this step; Ctrl-C again to abort without saving"

T = TypeVar("T")


def per_rank(total: int, key: str, dist_info: Dist) -> int:
    """``total`` split evenly over the ranks (a ``ValueError`` naming ``key`` when it does not)."""
    if total % dist_info.world_size:
        raise ValueError(
            f"{key}={total} must be divisible by the number of processes ({dist_info.world_size})"
        )
    return total // dist_info.world_size


def train_threads(cfg: Any) -> int:
    """The torch threads of each process of a run (``train.num_threads``; 0: torch's default):
    ``null`` is 1 when the actor's device (``actor.device``) is the CPU and 0 on CUDA. ``cfg``:
    a recipe config (``train``, ``actor``)."""
    if cfg.train.num_threads is not None:
        return cfg.train.num_threads
    return 0 if setup.resolve_device(cfg.actor).type == "cuda" else 1


@dataclass(frozen=True)
class Dist:
    """This process's place among the data-parallel ranks (1 rank under plain ``python``).

    ``rank`` and ``world_size`` count *data* ranks, the ones that sample their own prompts.
    Under sequence parallelism the ``replicas`` processes of an sp group are one data rank: they
    sample the same prompts with the same seeds and pass the engine the same mini-batch, whose
    tokens they split (docs/distributed.md). ``process`` is this process's own rank.
    """

    rank: int = 0
    world_size: int = 1
    replicas: int = 1
    process_rank: int | None = None

    @property
    def process(self) -> int:
        """This process's rank among all processes (what is written per process uses it)."""
        return self.rank if self.process_rank is None else self.process_rank

    @property
    def is_main(self) -> bool:
        return self.process == 0

    def for_sequence_parallel(self, size: int, key: str = "actor.sequence_parallel_size") -> Dist:
        """The data ranks when each ``size`` consecutive processes form an sp group (``self``
        for 1); a ``ValueError`` naming ``key`` when ``size`` does not divide the processes."""
        if size == 1:
            return self
        if self.replicas != 1 or self.world_size % size:
            raise ValueError(
                f"{key}={size} must divide the number of processes ({self.world_size})"
            )
        return Dist(self.rank // size, self.world_size // size, size, self.rank)

    @classmethod
    def init(cls) -> Dist:
        """Join the process group when launched by ``torchrun`` (gloo on CPU, nccl on GPU, each
        rank on its own GPU): :func:`microrl.engine.parallel.distributed.init_distributed`, the
        one initialiser the engine uses too."""
        distributed.init_distributed()
        return cls(distributed.rank(), distributed.world_size())

    def data_group(self, engine: Any) -> dist.ProcessGroup | None:
        """The process group with one process per data rank, for a collective over the rows that
        must count each data rank's rows once (PPO's whitening): the default group (None in a
        single process), or under sequence parallelism ``engine``'s data-parallel group (the
        ``dp`` dimension of its ``("dp", "sp")`` mesh: one process of each sp group), which is
        this layout since both put an sp group's processes consecutively."""
        return distributed.dp_group() if self.replicas == 1 else engine.dp_group

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's contiguous slice of ``items`` (sizes differ by at most 1)."""
        n = len(items)
        start = self.rank * n // self.world_size
        stop = (self.rank + 1) * n // self.world_size
        return list(items[start:stop])

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over data ranks (float64, so counts stay exact); the replicas of a
        data rank hold the same values and count once."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        if self.world_size * self.replicas > 1:
            tensor = distributed.all_reduce(tensor)  # on a group that takes host tensors
        return (tensor / self.replicas).tolist()

    def any(self, flag: bool) -> bool:
        return self.sum([float(flag)])[0] > 0

    def barrier(self) -> None:
        distributed.barrier()

    def close(self) -> None:
        """Wait for every rank and end the process group (also done at exit)."""
        distributed.shutdown()


class StepFailed(RuntimeError):
    """An exception raised during RL step ``step``; the original is its ``__cause__``."""

    def __init__(self, step: int, error: BaseException) -> None:
        super().__init__(f"step {step}: {type(error).__name__}: {error}")
        self.step = step
        self.error = error


class StopOnInterrupt:
    """Context manager around the step loop, turning the first SIGINT (Ctrl-C) into a polite stop
    request.

    The loop runs over :meth:`steps` and calls :meth:`should_stop` at each step boundary; under
    ``torchrun`` the flag is OR-reduced over ranks, so every rank stops after the same step and
    saves together. The first Ctrl-C says so on rank 0; a second one aborts at once. An exception
    raised in the loop leaves the block as :class:`StepFailed`, naming the step it was in.
    """

    def __init__(self, dist_info: Dist) -> None:
        self.dist = dist_info
        self.requested = False
        self.step: int | None = None  # the step running, for StepFailed
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True
        # A second Ctrl-C aborts immediately: the previous handler, or Python's own where there
        # was none to call (a process started with SIGINT ignored, as `nohup cmd &` starts it:
        # this handler took the first, so the second must not be ignored either).
        previous = self._previous if callable(self._previous) else signal.default_int_handler
        signal.signal(signal.SIGINT, previous)
        if self.dist.is_main:
            # os.write, not print: a handler that prints while the interrupted code is inside a
            # print to the same stream raises "reentrant call".
            lead = "\n" if sys.stderr.isatty() else ""  # off the progress bar's line
            os.write(sys.stderr.fileno(), f"{lead}{STOP_MESSAGE}\n".encode())

    def __enter__(self) -> StopOnInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        signal.signal(signal.SIGINT, self._previous)
        if isinstance(exc, Exception) and self.step is not None and not isinstance(exc, StepFailed):
            raise StepFailed(self.step, exc) from exc

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """``range(start, stop)``, remembering the step that runs (an error names it)."""
        for step in range(start, stop):
            self.step = step
            yield step

    def should_stop(self) -> bool:
        return self.dist.any(self.requested)
