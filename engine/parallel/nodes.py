"""Runs across several machines: which paths every rank must see, checked before they are used.

A path one rank writes and another reads must be on a file system every node mounts; otherwise
one node fails alone (its peers wait in a collective until the timeout). These helpers are
collective: every rank raises the same ``ValueError`` naming the path, ranks and hosts
(docs/distributed.md#several-nodes).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from microrl.engine.parallel import distributed

__all__ = [
    "SEVERAL_NODES_DOC",
    "check_shared_dir",
    "gather_with_hosts",
    "list_ranks",
    "shared_tempdir",
]

# A network file system may show another client a new file a moment late (attribute caches).
_VISIBILITY_WAIT_S = 2.0

SEVERAL_NODES_DOC = "docs/distributed.md#several-nodes"
_MARKER_PREFIX = ".microrl-shared-check-"


def gather_with_hosts(value: object) -> list[tuple[object, str]]:
    """Collective: every rank's ``(value, host name)``, by rank; ``value`` must be picklable."""
    mine = (value, socket.gethostname())
    if not distributed.is_distributed():
        return [mine]
    views: list[object] = [None] * distributed.world_size()
    dist.all_gather_object(views, mine)
    return views


def list_ranks(ranks: list[tuple[int, str]], limit: int = 4) -> str:
    """``"rank 1 on node-b, rank 3 on node-b and 5 more ranks"`` for ``(rank, host)`` pairs."""
    shown = ", ".join(f"rank {rank} on {host}" for rank, host in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more ranks" if len(ranks) > limit else "")


def check_shared_dir(path: str | os.PathLike, key: str) -> None:
    """Collective: make sure every rank sees the directory ``path`` that rank 0 sees.

    ``key`` names the setting in the error (``output.dir``). A no-op in a single process.

    Raises:
        ValueError: on every rank, naming ``key``, ``path`` and the ranks (and hosts) that do not
            see rank 0's marker file, or rank 0's own error when it cannot write there.
    """
    _check_visible(
        Path(path),
        f"{key}={os.fspath(path)}",
        f"Across nodes {key} must be on a file system every node mounts (NFS, Lustre, GPFS, "
        "...), given as the same absolute path on each",
    )


def shared_tempdir(prefix: str) -> str:
    """Collective: a fresh temporary directory rank 0 makes (under its ``TMPDIR``), checked
    visible at the same path on every rank (the exports for vLLM); the caller removes it, on rank 0.

    Raises:
        ValueError: on every rank that does not see it, naming ``TMPDIR`` (the directory removed).
    """
    box = [tempfile.mkdtemp(prefix=prefix) if distributed.rank() == 0 else None]
    if not distributed.is_distributed():
        return box[0]
    dist.broadcast_object_list(box, src=0)
    path = box[0]
    try:
        _check_visible(
            Path(path),
            f"the temporary directory {path} (made by rank 0 under its TMPDIR)",
            "Across nodes, set TMPDIR to the same directory of a file system every node mounts, "
            "on every node",
        )
    except ValueError:
        if distributed.rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def _check_visible(directory: Path, what: str, advice: str) -> None:
    if not distributed.is_distributed():
        return
    marker, box = None, [None]
    if distributed.rank() == 0:
        token, failure = secrets.token_hex(8), None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            marker = directory / f"{_MARKER_PREFIX}{token}"
            marker.write_text(token)
        except OSError as error:
            failure = f"{type(error).__name__}: {error}"
        box = [(token, failure)]
    dist.broadcast_object_list(box, src=0)
    token, failure = box[0]
    if failure is not None:
        raise ValueError(f"{what}: rank 0 cannot write there ({failure})")
    views = gather_with_hosts(_reads(directory / f"{_MARKER_PREFIX}{token}", token))
    if marker is not None:
        marker.unlink(missing_ok=True)
    distributed.barrier()  # the marker is gone on return, on every rank
    blind = [(rank, host) for rank, (seen, host) in enumerate(views) if not seen]
    if blind:
        raise ValueError(
            f"{what} is not the same directory on every process: rank 0 on {views[0][1]} wrote "
            f"a file there that {list_ranks(blind)} cannot read. {advice} ({SEVERAL_NODES_DOC})"
        )


def _reads(marker: Path, token: str) -> bool:
    """Whether ``marker`` holds ``token``, looking for up to :data:`_VISIBILITY_WAIT_S`."""
    deadline = time.monotonic() + _VISIBILITY_WAIT_S
    while True:
        try:
            if marker.read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
