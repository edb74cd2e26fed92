"""The bytes of a weight push between the trainer and an ``hf`` worker, in bounded chunks.

A push is one byte stream: every tensor of a layout, in layout order, each as the raw bytes of
its storage dtype (no cast: the worker holds the dtypes the trainer stores), cut into chunks of
at most ``chunk_bytes`` bytes, one gloo broadcast each. Chunks ignore tensor boundaries: a large
tensor spans several, and a chunk may hold the end of one tensor and the start of the next.

Neither side ever holds the whole layout on the host for the *first* push (every tensor of the
model, a 7B model's 15 GB in bf16): :func:`send_stream` copies each tensor (gathered one at a
time, possibly on a GPU) into two alternating chunk buffers, and :func:`receive_stream` scatters
each received chunk straight into the worker's tensors. The later pushes (what the optimizer
changes) are broadcast asynchronously so the trainer never waits for the worker: their bytes are
packed once (:func:`pack`, shared by a pool's workers) and kept until every chunk has left.
How the pieces fit: :mod:`microrl.rollout.worker.main`.
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
    "check_layout",
    "pack",
    "receive_stream",
    "send_chunks",
    "send_stream",
    "tensor_checksum",
    "total_bytes",
]

#: Bytes per broadcast of a push: what each side holds on the host for it (the trainer two while
#: streaming, one filling while the other is sent), whatever the model's size.
CHUNK_BYTES = 256 * 2**20

#: Elements whose float64 copy a checksum makes at a time (8 MiB).
_CHECKSUM_ELEMENTS = 2**20

#: A layout entry: a tensor's name, shape and storage dtype.
Entry = tuple[str, tuple[int, ...], torch.dtype]


class Packed(NamedTuple):
    """A push's bytes in one host buffer (uint8 ``[total_bytes(entries)]``) and each tensor's
    :func:`tensor_checksum`, by name."""

    buffer: torch.Tensor
    checksums: dict[str, tuple[float, float, float]]


def total_bytes(entries: Sequence[Entry]) -> int:
    """The bytes of a push of ``entries``."""
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in entries)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` as a flat uint8 tensor on its device: a view of its storage
    when it is contiguous (writing into the view writes the tensor), else of a contiguous copy."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def tensor_checksum(tensor: torch.Tensor) -> tuple[float, float, float]:
    """``(sum, sum of squares, sum of |x|)`` of ``tensor`` in float64, a bounded slice at a time
    (a whole float64 copy of a 7B model's embedding would be 4.4 GB); two copies of a tensor
    agree on all three to rounding, a stale or wrong one does not."""
    total = squares = magnitude = 0.0
    for part in tensor.detach().reshape(-1).split(_CHECKSUM_ELEMENTS):
        x = part.double()
        total += float(x.sum())
        squares += float((x * x).sum())
        magnitude += float(x.abs().sum())
    return total, squares, magnitude


def check_layout(found: Sequence[Entry], expected: Sequence[Entry], what: str) -> None:
    """``RuntimeError`` unless ``found`` (the tensors about to be pushed) are ``expected``
    (the layout the worker was told at its start), naming ``what`` pushes them."""
    if [(n, tuple(s), d) for n, s, d in found] != [(n, tuple(s), d) for n, s, d in expected]:
        raise RuntimeError(
            f"the engine's tensors changed since {what} started (names, shapes or dtypes): a "
            "worker copies a fixed set"
        )


def _checked(named: Iterable[tuple[str, torch.Tensor]], entries: Sequence[Entry]):
    """``named`` in lockstep with ``entries``; a tensor out of place is a ``RuntimeError``."""
    pairs = iter(named)
    for name, shape, dtype in entries:
        got = next(pairs, None)
        if got is None or got[0] != name or tuple(got[1].shape) != shape or got[1].dtype != dtype:
            found = "nothing" if got is None else f"{got[0]} {tuple(got[1].shape)} {got[1].dtype}"
            raise RuntimeError(f"push out of layout: expected {name} {shape} {dtype}, got {found}")
        yield got
    if next(pairs, None) is not None:
        raise RuntimeError("push out of layout: more tensors than the layout has")


def pack(named: Iterable[tuple[str, torch.Tensor]], entries: Sequence[Entry]) -> Packed:
    """Every tensor of ``named`` (in ``entries``' order, one at a time: a
    :class:`~microrl.rollout.weights.full_weights.FullWeights` pass) copied into one host buffer,
    with its checksum."""
    buffer = torch.empty(total_bytes(entries), dtype=torch.uint8)
    checksums, offset = {}, 0
    for name, tensor in _checked(named, entries):
        data = as_bytes(tensor)
        buffer[offset : offset + data.numel()].copy_(data)
        offset += data.numel()
        checksums[name] = tensor_checksum(tensor)
    return Packed(buffer, checksums)


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
    """Send ``named`` (in ``entries``' order) as the chunks of one push: each tensor is copied
    into two alternating host buffers of ``chunk_bytes`` (one filling while the other's
    ``broadcast`` runs), so at most two chunks are held, whatever the push's size. Returns each
    tensor's checksum once every chunk has been sent. ``broadcast(chunk)`` returns a work with
    ``wait()``."""
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
    """Receive a push of ``entries`` into ``tensors`` (the worker's, contiguous, on any device):
    ``receive(buffer)`` fills one chunk (it returns when the chunk has arrived), whose bytes are
    copied into the tensors they belong to before the next; one chunk buffer on the host."""
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
