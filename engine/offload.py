"""Activation offload: the tensors autograd saves for backward live in host memory in between.

A micro-batch's activation memory stays about one layer's forward and backward, not the whole
graph. :class:`ActivationOffload` is a ``saved_tensors_hooks`` context the engine enters around
each training forward with ``activation_offload`` (docs/distributed.md#activation-offload).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "MAX_IN_FLIGHT",
    "MIN_OFFLOAD_BYTES",
    "PREFETCH",
    "ActivationOffload",
    "OffloadStats",
    "release_pinned_memory",
]

#: Saved tensors smaller than this many bytes stay on the device.
MIN_OFFLOAD_BYTES = 1 << 20
#: CUDA: device-to-host copies in flight before the compute stream waits for the oldest.
MAX_IN_FLIGHT = 4
#: CUDA: offloaded tensors copied back ahead of the one the backward asks for.
PREFETCH = 2

# One side stream per CUDA device, shared by every block (copies on it are ordered).
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@dataclass
class OffloadStats:
    """What a block offloaded: ``tensors`` and ``bytes`` copied to the host (each tensor once;
    ``shared``: later saves reusing a copy), and the saved tensors kept on the device as small
    (``kept_small``) or parameters and weight copies (``kept_params``); ``records``: ``(shape,
    dtype, bytes)`` per copy with ``record=True``."""

    tensors: int = 0
    bytes: int = 0
    shared: int = 0
    kept_small: int = 0
    kept_params: int = 0
    records: list[tuple[tuple[int, ...], torch.dtype, int]] = field(default_factory=list)

    def add(self, other: OffloadStats) -> None:
        """Accumulate ``other`` into this one (records included)."""
        self.tensors += other.tensors
        self.bytes += other.bytes
        self.shared += other.shared
        self.kept_small += other.kept_small
        self.kept_params += other.kept_params
        self.records.extend(other.records)


class _Kept:
    """A saved tensor left in place: a detached alias and its version."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.version = tensor._version


class _Offloaded:
    """A saved tensor's host copy, its device, its saving order and, on CUDA, its copy back with the
    event recorded when that copy is done."""

    __slots__ = ("device", "fetched", "host", "index", "ready")

    def __init__(self, host: torch.Tensor, device: torch.device, index: int) -> None:
        self.host = host
        self.device = device
        self.index = index
        self.fetched: torch.Tensor | None = None  # the device copy (prefetched or unpacked)
        self.ready: torch.cuda.Event | None = None  # host-to-device copy done


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of the forward inside the block go to host memory; one per micro-batch.

    Args:
        params: the module's parameters and buffers (``DTensor`` shards too): a saved tensor
            sharing their storage stays on the device.
        min_bytes: smaller saved tensors stay on the device (None: :data:`MIN_OFFLOAD_BYTES`).
        record: keep ``(shape, dtype, bytes)`` of every offloaded tensor in ``stats.records``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] = (),
        *,
        min_bytes: int | None = None,
        record: bool = False,
    ) -> None:
        self.min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else int(min_bytes)
        if self.min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        self.record = record
        self.stats = OffloadStats()
        self._storages: set[int] = set()
        self._shapes: set[tuple[int, ...]] = set()
        for tensor in params:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.device.type != "meta" and local.numel():
                self._storages.add(local.untyped_storage().data_ptr())
            if isinstance(tensor, nn.Parameter) and tensor.dim() >= 2:
                self._shapes.add(tuple(tensor.shape))
                self._shapes.add(tuple(reversed(tensor.shape)))
        # CUDA: copies in flight, offloaded tensors by index (prefetch), end-of-backward queued.
        self._in_flight: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self._pending: dict[int, _Offloaded] = {}
        # Copied tensors by id (a weak reference and the version tell it is unchanged): once each.
        self._copied: dict[int, tuple[weakref.ref, int, _Offloaded]] = {}
        self._count = 0
        self._cleanup_queued = False
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        # Only the graph holds the copies now, so the backward frees each with its last node;
        # kept here they would live until the cycle collector reclaims this block.
        self._copied.clear()
        if self._in_flight:  # every copy must land before the compute stream reuses memory
            stream = _side_stream(self._in_flight[0][0].device)
            torch.cuda.current_stream(stream.device).wait_stream(stream)
            self._in_flight.clear()

    def _pack(self, tensor: torch.Tensor) -> _Kept | _Offloaded:
        if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
            if isinstance(tensor, nn.Parameter):
                self.stats.kept_params += 1
            return _Kept(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or tensor.device.type == "meta":
            self.stats.kept_small += 1
            return _Kept(tensor)
        if self._is_weight(tensor):
            self.stats.kept_params += 1
            return _Kept(tensor)
        earlier = self._copied.get(id(tensor))
        if earlier is not None and earlier[0]() is tensor and earlier[1] == tensor._version:
            self.stats.shared += 1
            return earlier[2]
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        if self.record:
            self.stats.records.append((tuple(tensor.shape), tensor.dtype, nbytes))
        self._count += 1
        if tensor.device.type == "cuda":
            packed = self._pack_cuda(tensor, self._count)
        else:
            host = torch.empty_like(tensor, device="cpu")
            host.copy_(tensor)  # a CPU tensor: a separate buffer; another device: a blocking copy
            packed = _Offloaded(host, tensor.device, self._count)
        self._copied[id(tensor)] = (weakref.ref(tensor), tensor._version, packed)
        return packed

    def _is_weight(self, tensor: torch.Tensor) -> bool:
        """A parameter or buffer, a view of one, or autocast's copy of a weight."""
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter):
            return True
        if tensor.untyped_storage().data_ptr() in self._storages:
            return True
        grad_fn = base.grad_fn
        if grad_fn is None:  # no autograd history: a frozen weight's cast has a weight's shape
            return not base.requires_grad and tuple(base.shape) in self._shapes
        if grad_fn.name() != "ToCopyBackward0":
            return False
        source = grad_fn.next_functions[0][0] if grad_fn.next_functions else None
        return isinstance(getattr(source, "variable", None), nn.Parameter)

    def _pack_cuda(self, tensor: torch.Tensor, index: int) -> _Offloaded:
        compute = torch.cuda.current_stream(tensor.device)
        side = _side_stream(tensor.device)
        # Drop landed copies; past the limit the compute stream waits for the oldest.
        while self._in_flight and self._in_flight[0][1].query():
            self._in_flight.popleft()
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            compute.wait_event(self._in_flight.popleft()[1])
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        side.wait_stream(compute)  # the tensor is complete before it is read
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
            copied = side.record_event()
        self._in_flight.append((tensor, copied))  # alive until the copy has read it
        packed = _Offloaded(host, tensor.device, index)
        self._pending[index] = packed
        return packed

    def _unpack(self, packed: _Kept | _Offloaded) -> torch.Tensor:
        if isinstance(packed, _Kept):
            if packed.tensor._version != packed.version:
                raise RuntimeError(
                    "a tensor saved for backward was modified in place after it was saved "
                    f"(version {packed.version} -> {packed.tensor._version}; activation offload)"
                )
            return packed.tensor
        if packed.device.type == "cpu":
            return packed.host
        if packed.device.type != "cuda":
            return packed.host.to(packed.device)
        return self._unpack_cuda(packed)

    def _unpack_cuda(self, packed: _Offloaded) -> torch.Tensor:
        compute = torch.cuda.current_stream(packed.device)
        self._queue_end_of_backward(packed.device)
        if packed.fetched is None:
            self._fetch(packed, compute)
        self._pending.pop(packed.index, None)
        # Prefetch the tensors saved just before this one: the backward needs them next.
        earlier = sorted((i for i in self._pending if i < packed.index), reverse=True)
        for index in earlier[:PREFETCH]:
            if self._pending[index].fetched is None:
                self._fetch(self._pending[index], compute)
        compute.wait_event(packed.ready)  # the copy has landed before the compute reads it
        return packed.fetched

    def _fetch(self, packed: _Offloaded, compute: torch.cuda.Stream) -> None:
        """Host-to-device copy on the side stream, into memory allocated on the compute stream."""
        side = _side_stream(packed.device)
        fetched = torch.empty_like(packed.host, device=packed.device)
        side.wait_stream(compute)  # the memory's previous users on the compute stream are done
        with torch.cuda.stream(side):
            fetched.copy_(packed.host, non_blocking=True)  # after the device-to-host copy
            packed.ready = side.record_event()
        packed.fetched = fetched

    def _queue_end_of_backward(self, device: torch.device) -> None:
        """At the end of the backward the compute stream waits for the side stream (a prefetched
        tensor never unpacked must not be freed under its copy)."""
        if self._cleanup_queued:
            return
        side = _side_stream(device)

        def wait() -> None:
            torch.cuda.current_stream(device).wait_stream(side)
            self._cleanup_queued = False

        try:
            torch.autograd.Variable._execution_engine.queue_callback(wait)
            self._cleanup_queued = True
        except RuntimeError:  # unpacked outside a backward (e.g. grad_fn._saved_self)
            wait()


def release_pinned_memory(device: torch.device) -> None:
    """Return the cached, unused pinned host blocks of torch's CUDA host allocator to the system (a
    no-op off CUDA): it never frees them itself, so activation copies and offloaded gradients would
    stay pinned through sampling. Blocks in use stay. Called by ``Engine.release_host_memory``."""
    if torch.device(device).type != "cuda":
        return
    empty = getattr(torch.accelerator, "empty_host_cache", None)  # else the CUDA-only name
    if empty is None:
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream
