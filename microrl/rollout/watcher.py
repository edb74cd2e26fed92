"""What a trainer starts ends with it, however the trainer ended (docs/async.md#when-the-trainer-dies).

:func:`watch` hands servers (process groups), workers and temporary directories to one watcher
process per trainer process, reading a pipe whose only write end the trainer holds: at its EOF
(SIGKILL included) the watcher stops what is still watched and removes the directories. Not
``PR_SET_PDEATHSIG``: it fires when the starting *thread* ends. A pid is checked against its
start time before a signal (never a reused pid). Stdlib only: it runs as a script.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = [
    "GRACE_S",
    "KINDS",
    "OWNER_FILE",
    "mark_owner",
    "release",
    "stop",
    "sweep_stale_dirs",
    "watch",
    "watched",
    "write_all",
]

#: What can be watched: a process group (a server and its children), one process, a directory.
KINDS = ("group", "process", "directory")
#: Seconds between SIGTERM and SIGKILL once the trainer is gone.
GRACE_S = 5.0
#: The file in a temporary directory naming the process that made it (:func:`mark_owner`).
OWNER_FILE = ".microrl-owner.json"
_POLL_S = 0.05
_SCRIPT = os.path.abspath(__file__)
_ABANDONED: list[subprocess.Popen] = []


def watch(kind: str, target: int | str | os.PathLike, *, label: str = "") -> None:
    """Have ``target`` stopped (a process ``group`` or ``process``) or removed (``directory``)
    once this process is gone, unless :func:`release` d first; ``label`` names it. ``ValueError``:
    an unknown ``kind``, a pid <= 1, this process or its group, a relative path or ``/``."""
    _watcher.watch(kind, target, label)


def release(kind: str, target: int | str | os.PathLike) -> None:
    """Stop watching ``target`` (its owner stopped or removed it); nothing if not watched."""
    _watcher.release(kind, target)


def watched() -> set[tuple[str, int | str]]:
    """What this process has watched and not released, as ``(kind, target)``."""
    return set(_watcher.entries)


def _key(kind: str, target) -> tuple[str, int | str]:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "directory":
        path = os.fspath(target)
        if not os.path.isabs(path) or os.path.dirname(path) == path:
            raise ValueError(f"a watched directory must be an absolute path below /, got {path!r}")
        return kind, path
    if isinstance(target, bool) or not isinstance(target, int) or target <= 1:
        raise ValueError(f"a watched {kind} must be a pid > 1, got {target!r}")
    if target == os.getpid() or (kind == "group" and target == os.getpgrp()):
        raise ValueError(f"a process cannot watch its own {kind} ({target})")
    return kind, target


class _Watcher:
    """This process's watcher: the pipe to it and what it watches (replayed to a new one)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[tuple[str, int | str], list] = {}
        self.fd: int | None = None
        self.process: subprocess.Popen | None = None

    def watch(self, kind: str, target, label: str) -> None:
        key = _key(kind, target)
        start = None if kind == "directory" else _start_time(key[1])
        with self.lock:
            self.entries[key] = ["+", *key, start, label]
            self._send(self.entries[key])

    def release(self, kind: str, target) -> None:
        key = _key(kind, target)
        with self.lock:
            if self.entries.pop(key, None) is not None:
                self._send(["-", *key])

    def _send(self, message: list) -> None:
        if self.fd is not None:
            try:
                _write(self.fd, message)
                return
            except OSError:  # the watcher died (EPIPE): a new one gets every entry
                self.forget()
        if self.entries:
            self._start()

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()  # neither end inheritable (PEP 446)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", _SCRIPT, str(read_fd), str(os.getpid())],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # stderr kept: it says what it stopped
                start_new_session=True,  # outside the trainer's process group
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self.fd = write_fd
        for message in self.entries.values():
            _write(write_fd, message)

    def forget(self) -> None:
        """Drop the pipe (a fork child's copy of its parent's, or a dead watcher's)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        if self.process is not None and self.process.poll() is None:
            _ABANDONED.append(self.process)  # kept: a Popen collected while it runs warns
        self.fd, self.process = None, None


def _after_fork() -> None:
    """A ``fork`` child closes its copy of the parent's pipe (the parent's watcher would wait)."""
    global _watcher
    _watcher.forget()
    _watcher = _Watcher()


def _write(fd: int, message: list) -> None:
    """One line of JSON, written whole (a pipe write of <= PIPE_BUF bytes is atomic)."""
    write_all(fd, (json.dumps(message) + "\n").encode())


def write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd`` (``os.write`` may write fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _stat(pid: int) -> tuple[str, int, str] | None:
    """``(state, process group, start time)`` of ``pid`` from ``/proc`` (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rpartition(")")[2].split()
        return fields[0], int(fields[2]), fields[19]
    except (OSError, IndexError, ValueError):
        return None


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), or None (gone, or no ``/proc``)."""
    stat = _stat(pid)
    return None if stat is None else stat[2]


def _signal(kind: str, target: int, sig: int) -> bool:
    """Send ``sig`` to the ``process`` or ``group`` ``target``; False when none exists."""
    try:
        (os.killpg if kind == "group" else os.kill)(target, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        pass
    return True


def _alive(kind: str, target: int) -> bool:
    """Whether the process ``target`` (``group``: a process of group ``target``) runs; a
    zombie, dead but not reaped, does not."""
    if not _signal(kind, target, 0):
        return False
    if not os.path.isdir("/proc/self"):  # no /proc: it runs
        return True
    pids = [int(n) for n in os.listdir("/proc") if n.isdigit()] if kind == "group" else [target]
    stats = [stat for stat in map(_stat, pids) if stat is not None]
    return any(s[0] not in "ZX" and (kind == "process" or s[1] == target) for s in stats)


def _same_process(kind: str, target: int, start: str | None) -> bool:
    """Whether ``target`` started when it did (a leaderless group: yes, its pgid is not reused)."""
    now = _start_time(target)
    return start is None or now == start or (kind == "group" and now is None)


def stop(processes: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """SIGTERM (and SIGCONT: a stopped process gets it now) each ``(kind, pid)``, SIGKILL after
    :data:`GRACE_S`; what still runs :data:`GRACE_S` after that."""
    for signals in ((signal.SIGTERM, signal.SIGCONT), (signal.SIGKILL,)):
        for kind, target in processes:
            for sig in signals:
                _signal(kind, target, sig)
        deadline = time.monotonic() + GRACE_S
        while (processes := [p for p in processes if _alive(*p)]) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return processes


def _clean_up(entries: dict[tuple[str, int | str], tuple], trainer: int) -> None:
    """Stop the watched processes, then remove the watched directories; say so on stderr."""
    processes = [
        (kind, target)
        for (kind, target), (start, _) in entries.items()
        if kind != "directory" and _same_process(kind, target, start)
    ]
    left = stop(processes)
    directories = [target for kind, target in entries if kind == "directory"]
    for path in directories:
        shutil.rmtree(path, ignore_errors=True)
    message = f"microrl: the trainer (pid {trainer}) ended without closing what it started"
    stopped = [label or f"{k} {t}" for (k, t), (_, label) in entries.items() if k != "directory"]
    if stopped:
        message += f"; stopped {', '.join(stopped)}"
    if left:
        message += f" ({', '.join(f'{k} {t}' for k, t in left)} still running after SIGKILL)"
    if directories:
        message += f"; removed {', '.join(directories)}"
    print(message, file=sys.stderr, flush=True)


def _watch_pipe(fd: int, trainer: int) -> None:
    """Read what the trainer watches and releases until it is gone; then clean up."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    entries: dict[tuple[str, int | str], tuple] = {}
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            try:
                op, kind, target, *rest = json.loads(line)
            except ValueError:
                continue
            if op == "+":
                entries[kind, target] = (rest[0], rest[1])
            else:
                entries.pop((kind, target), None)
    if entries:
        _clean_up(entries, trainer)


def _identity() -> dict[str, str | None]:
    """This machine, boot and pid namespace: where a pid means the same process."""
    boot = namespace = None
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError):
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    return {"host": socket.gethostname(), "boot": boot, "pid_namespace": namespace}


def mark_owner(directory: str | os.PathLike) -> None:
    """Write :data:`OWNER_FILE` (this process's identity) into ``directory`` for :func:`sweep_stale_dirs`."""
    owner = {**_identity(), "pid": os.getpid(), "start": _start_time(os.getpid())}
    (Path(directory) / OWNER_FILE).write_text(json.dumps(owner))


def _owner_dead(owner: dict) -> bool:
    """Whether the owner :func:`mark_owner` recorded is dead for sure."""
    here = _identity()
    if owner.get("host") != here["host"]:
        return False
    if owner.get("boot") != here["boot"]:
        return owner.get("boot") is not None and here["boot"] is not None
    if owner.get("pid_namespace") != here["pid_namespace"]:
        return False
    pid, start = owner.get("pid"), owner.get("start")
    if not isinstance(pid, int) or pid <= 1:
        return False
    if start is not None:
        return _start_time(pid) != start
    return not _signal("process", pid, 0)


def sweep_stale_dirs(prefix: str, parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove (and return) the directories ``<prefix>*`` in ``parent`` of a dead owner."""
    parent = Path(parent if parent is not None else tempfile.gettempdir())
    removed = []
    with contextlib.suppress(OSError):
        candidates = [p for p in parent.iterdir() if p.name.startswith(prefix)]
        for path in candidates:
            try:
                owner = json.loads((path / OWNER_FILE).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(owner, dict) and _owner_dead(owner):
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    removed.append(path)
    return removed


if __name__ == "__main__":  # the watcher process: python -I -S watcher.py <fd> <trainer pid>
    _watch_pipe(int(sys.argv[1]), int(sys.argv[2]))
else:
    _watcher = _Watcher()
    if hasattr(os, "register_at_fork"):  # POSIX
        os.register_at_fork(after_in_child=_after_fork)
