"""Message channels between microrl's processes that end when either side dies, at any point.

Not a ``multiprocessing.Queue`` (a writer killed mid-message blocks its reader for good): each
direction is one pipe of which each process keeps one end, so either side's death is
:class:`ChannelClosed` at the other. :class:`Sender` writes from a thread.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from microrl.rollout.watcher import write_all

__all__ = ["ChannelClosed", "Receiver", "Sender", "start_process"]

# Each message: its length (8 bytes, big-endian), then its pickle.
_HEADER = struct.Struct("!Q")
_CHUNK = 1 << 20


class ChannelClosed(EOFError):
    """The process at the other end of a channel is gone (it died, exited or closed its end)."""


class Receiver:
    """The reading end of a channel: :meth:`get` returns the next whole message."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._buffer = bytearray()

    def get(self, timeout: float | None = None) -> Any:
        """The next message, waiting at most ``timeout`` seconds (None: without end; 0: if it is
        here whole), else ``queue.Empty``; :class:`ChannelClosed` when the writer is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (size := self._whole_message()) is None:
            self._read(deadline)
        end = _HEADER.size + size
        with memoryview(self._buffer) as view:  # unpickled in place: no copy of a big message
            message = pickle.loads(view[_HEADER.size : end])  # a Sender of ours, never a stranger
        del self._buffer[:end]
        return message

    def close(self) -> None:
        self._connection.close()

    def _whole_message(self) -> int | None:
        """The size of the first message when it is in the buffer whole, else None."""
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        return size if len(self._buffer) >= _HEADER.size + size else None

    def _read(self, deadline: float | None) -> None:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self._connection.closed:
            raise ChannelClosed("this end of the channel was closed")
        if not self._connection.poll(remaining):  # readable: data, or EOF
            raise queue.Empty
        chunk = os.read(self._connection.fileno(), _CHUNK)
        if not chunk:
            cut = f" in the middle of a message ({len(self._buffer)} bytes)" if self._buffer else ""
            raise ChannelClosed(f"the writer closed its end{cut}")
        self._buffer += chunk


class Sender:
    """The writing end of a channel: :meth:`put` pickles a message, a thread writes it."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._pending: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._error: OSError | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._write_pending, name="microrl-channel-writer", daemon=True
        )
        self._thread.start()

    def put(self, message: Any) -> None:
        """Send ``message``; :class:`ChannelClosed` when an earlier write saw the reader gone."""
        if self._closed:
            raise ChannelClosed("this end of the channel was closed")
        if self._error is not None:
            raise ChannelClosed(f"the reader is gone ({self._error})") from self._error
        self._pending.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self, timeout: float = 5.0) -> None:
        """Write what was put (at most ``timeout`` seconds), then close this end; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():  # never close a descriptor a thread still writes to
            self._connection.close()

    def _write_pending(self) -> None:
        fd = self._connection.fileno()
        while (data := self._pending.get()) is not None:
            try:
                write_all(fd, _HEADER.pack(len(data)))
                write_all(fd, data)
            except OSError as err:  # BrokenPipeError: no process holds the reading end
                self._error = err
                return


def start_process(
    context: BaseContext, target: Callable[..., Any], args: Sequence[Any], **process_options: Any
) -> tuple[Any, Sender, Receiver]:
    """Start ``target(*args, commands, results)`` (connections for a :class:`Receiver`, a
    :class:`Sender`) in a process of ``context``, not ``fork`` (it would inherit this side's
    ends). Returns the process, the :class:`Sender` of commands, :class:`Receiver` of results."""
    if context.get_start_method() == "fork":
        raise ValueError("start_process needs a 'spawn' or 'forkserver' context, not 'fork'")
    commands_read, commands_write = context.Pipe(duplex=False)
    results_read, results_write = context.Pipe(duplex=False)
    process = context.Process(
        target=target, args=(*args, commands_read, results_write), **process_options
    )
    try:
        process.start()
    except BaseException:
        for end in (commands_write, results_read):
            end.close()
        raise
    finally:  # the child's ends: while this process holds them, the child's death is no EOF
        for end in (commands_read, results_write):
            end.close()
    return process, Sender(commands_write), Receiver(results_read)
