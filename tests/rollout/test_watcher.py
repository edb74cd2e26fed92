"""The trainer's watcher (microrl/rollout/watcher.py): what a trainer started is stopped and
removed once the trainer is gone, whatever ended it; nothing else is touched.

A watcher sees its trainer's death as the end of its pipe: these tests close the pipe of a
watcher of their own (``_Watcher().forget()``) instead of killing the test process;
tests/faults/test_killed_trainer.py SIGKILLs a real trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from microrl.rollout import watcher
from microrl.rollout.samplers import vllm_options

# A server standing in for `vllm serve`: its own session, and a child (its "engine core") in
# its process group; it prints the child's pid.
SERVER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
# The watcher's SIGTERM ends these at once; a loaded machine may be slow to run it.
DEADLINE_S = 20.0


def _wait_gone(watcher_process: subprocess.Popen) -> None:
    watcher_process.wait(timeout=DEADLINE_S + 2 * watcher.GRACE_S)


def test_a_dead_trainers_group_process_and_directory_are_stopped_and_removed(tmp_path):
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    worker = subprocess.Popen(SLEEPER)
    engine_core = int(server.stdout.readline())
    workdir, kept = tmp_path / "microrl-vllm-servers-x", tmp_path / "kept"
    (workdir / "base").mkdir(parents=True)
    kept.mkdir()
    own = watcher._Watcher()
    try:
        own.watch("group", server.pid, "a stand-in server")
        own.watch("process", worker.pid, "a worker")
        own.watch("directory", workdir, "")
        own.watch("directory", kept, "")
        own.release("directory", kept)  # released: its owner removes it, or keeps it
        assert set(own.entries) == {
            ("group", server.pid),
            ("process", worker.pid),
            ("directory", str(workdir)),
        }
        process = own.process
        assert server.poll() is None and worker.poll() is None  # nothing stops while it lives
        own.forget()  # the trainer's end, as the watcher sees it
        _wait_gone(process)
        assert server.wait(timeout=5) == -15 and worker.wait(timeout=5) == -15  # SIGTERM
        assert not watcher._alive("process", engine_core)  # the server's whole group
        assert not workdir.exists() and kept.exists()
    finally:
        for proc in (server, worker):
            proc.kill()
            proc.wait()
        if watcher._alive("process", engine_core):
            os.kill(engine_core, 9)


def test_a_pid_reused_by_another_process_is_never_signalled(monkeypatch):
    other = subprocess.Popen(SLEEPER)
    own = watcher._Watcher()
    try:
        # Watched as a process that started at another time: the pid now names another one.
        monkeypatch.setattr(watcher, "_start_time", lambda pid: "1")
        own.watch("process", other.pid, "")
        monkeypatch.undo()
        process = own.process
        own.forget()
        _wait_gone(process)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_a_new_watcher_takes_over_when_the_watcher_dies(tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    own = watcher._Watcher()
    try:
        own.watch("directory", directory, "")
        first = own.process
        first.kill()
        first.wait()
        other = tmp_path / "e"
        other.mkdir()
        own.watch("directory", other, "")  # EPIPE: a new watcher gets both
        assert own.process is not first
        process = own.process
        own.forget()
        _wait_gone(process)
        assert not directory.exists() and not other.exists()
    finally:
        own.forget()


def test_a_fork_child_closes_its_copy_of_the_pipe(tmp_path):
    """A forked child holding the trainer's pipe would keep the watcher from seeing its end."""
    watcher.watch("directory", tmp_path, label="")
    try:
        fd = watcher._watcher.fd
        pid = os.fork()
        if pid == 0:  # the child: the inherited copy of the pipe is closed
            try:
                os.fstat(fd)
                code = 1
            except OSError:
                code = 0
            os._exit(code if watcher._watcher.fd is None else 2)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        watcher.release("directory", tmp_path)


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="its own group"):
        watcher.watch("group", os.getpgrp())
    with pytest.raises(ValueError, match="its own process"):
        watcher.watch("process", os.getpid())
    with pytest.raises(ValueError, match="pid > 1"):
        watcher.watch("process", 1)
    with pytest.raises(ValueError, match="absolute path"):
        watcher.watch("directory", "relative")
    with pytest.raises(ValueError, match="kind must be one of"):
        watcher.watch("file", "/tmp/x")


def _owned(tmp_path, name: str, **owner) -> os.PathLike:
    path = tmp_path / name
    path.mkdir()
    watcher.mark_owner(path)
    marker = path / watcher.OWNER_FILE
    marker.write_text(json.dumps({**json.loads(marker.read_text()), **owner}))
    return path


def test_a_start_sweeps_the_directories_of_dead_owners_only(tmp_path, monkeypatch, caplog):
    dead = subprocess.Popen(SLEEPER)
    dead.kill()
    dead.wait()
    stale = [
        _owned(tmp_path, "microrl-vllm-servers-a", pid=dead.pid),  # its owner is gone
        _owned(tmp_path, "microrl-vllm-b", start="1"),  # this pid, reused by this process
        _owned(tmp_path, "microrl-vllm-c", boot="an-earlier-boot"),
    ]
    kept = [
        _owned(tmp_path, "microrl-vllm-d"),  # alive: this process
        _owned(tmp_path, "microrl-vllm-e", pid=dead.pid, host="another-node"),
        _owned(tmp_path, "microrl-vllm-f", pid=dead.pid, pid_namespace="another-container"),
        _owned(tmp_path, "other-g", pid=dead.pid),  # another prefix
    ]
    (tmp_path / "microrl-vllm-h").mkdir()  # unmarked (an older microrl's): unknown owner
    kept.append(tmp_path / "microrl-vllm-h")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    workdir, owned = vllm_options.make_workdir(None, "microrl-vllm-servers-")
    try:
        assert owned and workdir.parent == tmp_path
        assert all(not p.exists() for p in stale) and all(p.exists() for p in kept)
        assert "left by a microrl process that was killed" in caplog.text
        # The new directory is marked and watched until it is removed.
        assert json.loads((workdir / watcher.OWNER_FILE).read_text())["pid"] == os.getpid()
        assert ("directory", str(workdir)) in watcher.watched()
    finally:
        vllm_options.remove_workdir(workdir, owned=owned)
    assert not workdir.exists() and ("directory", str(workdir)) not in watcher.watched()
