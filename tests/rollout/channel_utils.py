"""Stand-in processes for the channel tests (tests/rollout/test_channel.py): picklable by
reference, so spawned children and a stand-in parent script import them from here."""

from __future__ import annotations

import os
import time

from microrl.rollout.channel import ChannelClosed, Receiver, Sender

BIG = b"x" * (1 << 22)  # 4 MiB: far beyond a pipe's buffer, so its writer blocks mid-message


def dies_mid_message(commands, results) -> None:
    """A stand-in worker: one whole message, then the first bytes of a big one, then death."""
    outbox = Sender(results)
    outbox.put(("hello", os.getpid()))
    outbox.put(("done", BIG))  # its writer thread blocks once the pipe is full
    time.sleep(0.5)
    os._exit(9)


def echoes(commands, results) -> None:
    """A stand-in worker that answers each command until its parent is gone."""
    inbox, outbox = Receiver(commands), Sender(results)
    try:
        while True:
            outbox.put(("echo", inbox.get()))
    except ChannelClosed:
        outbox.close(timeout=1)
