"""The bytes of a weight push between the trainer and an ``hf`` worker, in bounded chunks.

A push is every tensor of a layout, in order, as raw bytes of its storage dtype, cut into chunks
of at most ``chunk_bytes`` (one gloo broadcast each). The first push (the whole model) is
streamed, never whole on the host; later ones are packed once (:func:`pack`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

__all__ = [
    "CHUNK_BYTES",
    "Entry",
    "Packed",
    "as_bytes",
    "pack",
    "receive_stream",
    "send_chunks",
    "send_stream",
    "tensor_checksum",
    "total_bytes",
]

#: Bytes per broadcast of a push: what each side holds on the host (the streaming trainer two).
CHUNK_BYTES = 256 * 2**20

#: Elements whose float64 copy a checksum makes at a time (8 MiB).
_CHECKSUM_ELEMENTS = 2**20

#: A layout entry: a tensor's name, shape and storage dtype.
Entry = tuple[str, tuple[int, ...], torch.dtype]


class Packed(NamedTuple):
    """A push's bytes (uint8 ``[total_bytes(entries)]`` on the host) and checksums by name."""

    buffer: torch.Tensor
    checksums: dict[str, tuple[float, float, float]]


def total_bytes(entries: Sequence[Entry]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s raw bytes, flat uint8 on its device: a view when contiguous, else a copy's."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def tensor_checksum(tensor: torch.Tensor) -> tuple[float, float, float]:
    """``(sum, sum of squares, sum of |x|)`` of ``tensor`` in float64, a bounded slice at a time
    (a 7B embedding's float64 copy is 4.4 GB): a stale or wrong copy differs beyond rounding."""
    total = squares = magnitude = 0.0
    for part in tensor.detach().reshape(-1).split(_CHECKSUM_ELEMENTS):
        x = part.double()
        total += float(x.sum())
        squares += float((x * x).sum())
        magnitude += float(x.abs().sum())
    return total, squares, magnitude


_CHANGED = "the engine's tensors changed since the worker started (it copies a fixed set)"


def _checked(named: Iterable[tuple[str, torch.Tensor]], entries: Sequence[Entry]):
    """``named`` in lockstep with ``entries``; a tensor out of place is a ``RuntimeError``."""
    pairs = iter(named)
    for name, shape, dtype in entries:
        got = next(pairs, None)
        if got is None or got[0] != name or tuple(got[1].shape) != shape or got[1].dtype != dtype:
            found = "nothing" if got is None else f"{got[0]} {tuple(got[1].shape)} {got[1].dtype}"
            raise RuntimeError(f"{_CHANGED}: expected {name} {shape} {dtype}, got {found}")
        yield got
    if next(pairs, None) is not None:
        raise RuntimeError(f"{_CHANGED}: more tensors than the layout has")


def pack(named: Iterable[tuple[str, torch.Tensor]], entries: Sequence[Entry]) -> Packed:
    """Every tensor of ``named`` (in ``entries``' order) copied into one host buffer: a
    :func:`send_stream` of one chunk, kept."""
    chunks: list[torch.Tensor] = []
    checksums = send_stream(named, entries, chunks.append, max(1, total_bytes(entries)))
    return Packed(chunks[0] if chunks else torch.empty(0, dtype=torch.uint8), checksums)


def send_chunks(buffer: torch.Tensor, broadcast: Callable[[torch.Tensor], Any], chunk_bytes: int):
    """``broadcast`` each chunk of ``buffer`` (slices, no copies); returns their works."""
    return [
        broadcast(buffer[start : start + chunk_bytes])
        for start in range(0, buffer.numel(), chunk_bytes)
    ]


def send_stream(
    named: Iterable[tuple[str, torch.Tensor]],
    entries: Sequence[Entry],
    broadcast: Callable[[torch.Tensor], Any],
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, tuple[float, float, float]]:
    """Send ``named`` (in ``entries``' order) through two alternating ``chunk_bytes`` host
    buffers (one fills while the other's ``broadcast`` work runs); returns the checksums."""
    total = total_bytes(entries)
    size = max(1, min(chunk_bytes, total))
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(1 if total <= size else 2)]
    works: list[Any] = [None] * len(buffers)
    current, used, checksums = 0, 0, {}

    def flush(count: int) -> None:
        nonlocal current, used
        works[current] = broadcast(buffers[current][:count])
        current, used = (current + 1) % len(buffers), 0
        if works[current] is not None:  # the next buffer is refilled once its chunk has left
            works[current].wait()
            works[current] = None

    for name, tensor in _checked(named, entries):
        checksums[name] = tensor_checksum(tensor)
        data, offset = as_bytes(tensor), 0
        while offset < data.numel():
            n = min(size - used, data.numel() - offset)
            buffers[current][used : used + n].copy_(data[offset : offset + n])
            used, offset = used + n, offset + n
            if used == size:
                flush(size)
        del data, tensor  # before the next gather: one full tensor at a time
    if used:
        flush(used)
    for work in works:
        if work is not None:
            work.wait()
    return checksums


def receive_stream(
    tensors: Mapping[str, torch.Tensor],
    entries: Sequence[Entry],
    receive: Callable[[torch.Tensor], None],
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Receive a push of ``entries`` into the contiguous ``tensors``: ``receive(buffer)`` fills
    one chunk, copied into its tensors before the next (one chunk buffer on the host)."""
    for name, _, _ in entries:
        if not tensors[name].is_contiguous():  # its bytes would land in a copy
            raise RuntimeError(f"cannot receive {name} in place: it is not contiguous")
    total = total_bytes(entries)
    buffer = torch.empty(max(1, min(chunk_bytes, total)), dtype=torch.uint8)
    targets = iter([as_bytes(tensors[name]) for name, _, _ in entries])
    target, filled = None, 0
    for start in range(0, total, buffer.numel()):
        chunk = buffer[: min(buffer.numel(), total - start)]
        receive(chunk)
        read = 0
        while read < chunk.numel():
            if target is None or filled == target.numel():
                target, filled = next(targets), 0
            n = min(chunk.numel() - read, target.numel() - filled)
            target[filled : filled + n].copy_(chunk[read : read + n])
            read, filled = read + n, filled + n
