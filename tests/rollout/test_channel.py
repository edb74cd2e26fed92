"""The channels between microrl's processes (microrl/rollout/channel.py).

- A writer killed in the middle of a message is :class:`ChannelClosed` at its reader within
  seconds, not a read that waits for bytes that never come (a ``multiprocessing.Queue`` blocks
  its reader for good there: its reader holds the write end too).
- A reader's death is :class:`ChannelClosed` at the writer's next ``put``, and a parent killed
  in the middle of a command ends its child's wait at once.
- A message still arriving when a ``get`` times out is kept whole for the next one; a sender
  never waits for its reader; a forking context is refused.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time

import pytest
from channel_utils import BIG, dies_mid_message, echoes

from microrl.rollout.channel import ChannelClosed, start_process

SPAWN = multiprocessing.get_context("spawn")


def test_a_writer_killed_mid_message_closes_the_channel_within_seconds() -> None:
    process, commands, results = start_process(SPAWN, dies_mid_message, ())
    try:
        assert results.get(timeout=60)[0] == "hello"
        process.join(30)  # nothing read meanwhile: the pipe holds the big message's first bytes
        start = time.monotonic()
        with pytest.raises(ChannelClosed, match="in the middle of a message"):
            results.get(timeout=30)  # EOF after those bytes, not a wait for the rest
        assert time.monotonic() - start < 5
        assert process.exitcode == 9
        with pytest.raises(ChannelClosed):  # the reader is gone: the writer is told
            for _ in range(100):
                commands.put(("generate",))
                time.sleep(0.05)
    finally:
        process.kill()
        process.join()


def test_messages_cross_both_ways_and_a_timed_out_get_loses_nothing() -> None:
    process, commands, results = start_process(SPAWN, echoes, (), daemon=True)
    try:
        with pytest.raises(queue.Empty):
            results.get(timeout=0)
        for _ in range(3):  # 12 MiB each way: neither side waits for the other to read
            commands.put(BIG)
        got = []
        while len(got) < 3:
            with contextlib.suppress(queue.Empty):  # times out mid-message, many times
                got.append(results.get(timeout=0.001))
        assert got == [("echo", BIG)] * 3
        commands.close()  # the child sees its channel end and exits
        process.join(30)
        assert process.exitcode == 0
        with pytest.raises(ChannelClosed, match=r"the writer closed its end$"):
            results.get(timeout=5)
    finally:
        process.kill()
        process.join()


PARENT = """
import os, sys, time, multiprocessing
sys.path.insert(0, {tests!r})
from channel_utils import echoes
from microrl.rollout.channel import start_process
if __name__ == "__main__":
    process, commands, results = start_process(multiprocessing.get_context("spawn"), echoes, ())
    commands.put("ping")
    results.get(timeout=60)
    print(process.pid, flush=True)
    os.kill(process.pid, 19)  # SIGSTOP: the child reads nothing while this writes
    commands.put(b"x" * (1 << 22))
    time.sleep(60)
"""


def test_a_parent_killed_mid_command_ends_its_childs_wait() -> None:
    script = PARENT.format(tests=os.path.dirname(__file__))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the parent's writer fills the pipe with the command's first bytes
        parent.kill()
        parent.wait()
        os.kill(child, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the child still waits for the rest of its dead parent's command"
    finally:
        parent.kill()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped by its dead parent's init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_forking_context_is_refused() -> None:
    with pytest.raises(ValueError, match="'spawn' or 'forkserver'"):
        start_process(multiprocessing.get_context("fork"), echoes, ())
