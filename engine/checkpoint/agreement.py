"""Agreements of the ranks on the outcome of a step, in bounded time, instead of bare barriers.

A failure on one rank fails every rank within ``timeout_s``, naming it: each rank posts "ok" or
its error in the rendezvous store, which (unlike a broken collective) tells who never posted.
Protocol and bounds: docs/checkpoints.md#a-failure-on-one-rank.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import math
import os
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from microrl.engine.parallel import distributed

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "CheckpointAbortedError",
    "RankSync",
    "phase",
    "rank_agreement",
    "resolve_timeout",
]

# Seconds a rank waits for the others at each step: the slowest rank's write after the fastest.
TIMEOUT_ENV = "MICRORL_CHECKPOINT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
_STORE_PREFIX = "microrl/checkpoint"
_MAX_REASON = 400  # characters of one rank's error text in an agreement's message


class CheckpointAbortedError(RuntimeError):
    """A multi-rank save or load that failed because of other ranks (``failed_ranks``), raised on
    the ranks whose own part succeeded; the failed ranks re-raise their own exception."""

    def __init__(self, message: str, failed_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.failed_ranks = tuple(failed_ranks)


def resolve_timeout(timeout_s: float | None) -> float:
    source = "timeout_s"
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT_S
        source = TIMEOUT_ENV
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ValueError(f"{source} must be a finite number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


# Side gloo groups for DCP's collectives, one per timeout (a group's timeout is fixed at creation).
_side_groups: dict[float, dist.ProcessGroup] = {}
# Numbers this process's multi-rank operations, in the same order on every rank (store keys).
_sequence = itertools.count()
# This rank's status keys that every rank has read: deleted at its next completed agreement.
_read_keys: list[str] = []


def _side_group(timeout_s: float) -> dist.ProcessGroup:
    group = _side_groups.get(timeout_s)
    if group is None or not _registered(group):  # collective: every rank is in the same save/load
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        _side_groups[timeout_s] = group
    return group


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` still belongs to the live default group (not destroyed with an earlier one)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


@atexit.register
def _release_side_groups() -> None:
    """Free the side groups while the interpreter lives: joined at its finalization instead, a
    gloo thread still freeing a collective's tensor takes the GIL and aborts the process
    ("terminate called without an active exception"). Destroyed here or, when their default
    group still lives, by the engine's exit ``shutdown``."""
    _side_groups.clear()


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _blame(error: BaseException, rank: int) -> dict[str, str]:
    """``{rank: reason}`` for the ranks ``error`` comes from: DCP's ``CheckpointException`` names
    the ranks whose part of its collective step failed; anything else is this rank's own."""
    if isinstance(error, CheckpointException) and error.failures:
        return {str(r): _describe(exc) for r, (exc, _) in sorted(error.failures.items())}
    return {str(rank): _describe(error)}


class RankSync:
    """The agreements of one multi-rank operation (a save, a load, an export): see
    docs/checkpoints.md, "A failure on one rank". ``what`` names it in error messages."""

    def __init__(self, what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # The default group's store (no public accessor in torch 2.9-2.13; pinned by
        # test_the_private_default_store_accessor_still_exists).
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"{_STORE_PREFIX}/{next(_sequence)}"
        self.group = _side_group(timeout_s)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run this rank's part of phase ``name``; returns only if every rank succeeded."""
        try:
            yield
        except BaseException as error:
            self._agree(name, error)  # raises CheckpointAbortedError unless ours is a cause
            raise
        self._agree(name, None)

    def _agree(self, phase: str, error: BaseException | None) -> None:
        key = f"{self.prefix}/{phase}"
        keys = [f"{key}/rank{r}" for r in range(self.world)]
        failed_flag = f"{key}/failed"
        try:
            if error is not None:  # before our status: whoever sees all statuses sees the flag
                self.store.set(failed_flag, "1")
            status = {} if error is None else {"errors": _blame(error, self.rank)}
            self.store.set(keys[self.rank], json.dumps(status))
            try:
                self.store.wait(keys, timedelta(seconds=self.timeout_s))
                missing: list[int] = []
            except RuntimeError:  # DistStoreError: timed out (or the store is gone: check raises)
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                # Every rank posted here, so every rank has read our previous status keys.
                for stale in _read_keys:
                    with contextlib.suppress(Exception):
                        self.store.delete_key(stale)
                _read_keys[:] = [keys[self.rank]]
                if error is None and not self.store.check([failed_flag]):
                    return
            present = [r for r in range(self.world) if r not in missing]
            statuses = {r: json.loads(self.store.get(keys[r])) for r in present}
        except Exception as store_error:
            raise CheckpointAbortedError(
                f"{self.what} failed: could not reach the rendezvous store to learn "
                f"the other ranks' outcome of the {phase} phase ({_describe(store_error)}); the "
                "rank hosting it (rank 0 when not launched by torchrun) may have died"
                + (f"; this rank: {_describe(error)}" if error is not None else "")
            ) from (error if error is not None else store_error)
        errors: dict[int, str] = {}
        for reporter, status in statuses.items():
            for blamed, reason in status.get("errors", {}).items():
                if int(blamed) == reporter or int(blamed) not in errors:
                    errors[int(blamed)] = reason  # a rank's own report of itself wins
        failed = sorted(missing) if missing else sorted(errors)
        parts = [
            f"rank {r}: no status within {self.timeout_s:g} s (killed, hung or out of memory?)"
            for r in missing
        ]
        parts += [f"rank {r}: {reason}" for r, reason in sorted(errors.items())]
        message = f"{self.what} failed on rank(s) {failed} in the {phase} phase: " + "; ".join(
            parts
        )
        if error is not None and self.rank in failed:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(message)
            return  # the caller re-raises this rank's own exception
        raise CheckpointAbortedError(message, tuple(failed)) from error


def phase(sync: RankSync | None, name: str) -> contextlib.AbstractContextManager:
    return sync.phase(name) if sync is not None else contextlib.nullcontext()


def rank_agreement(what: str, timeout_s: float | None = None) -> contextlib.AbstractContextManager:
    """A block that returns on every rank only if it succeeded on all: an exception on one makes
    the others raise :class:`CheckpointAbortedError` naming it, a rank that never arrives is named
    after ``timeout_s``. For single-writer steps (exports). A no-op in one process."""
    timeout = resolve_timeout(timeout_s)
    sync = RankSync(what, timeout) if distributed.world_size() > 1 else None
    return phase(sync, "write")
