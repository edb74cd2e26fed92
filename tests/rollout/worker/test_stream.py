"""A weight push in bounded chunks (microrl/rollout/worker/stream.py).

Before it, the first push of an ``hf`` worker gathered every tensor into host copies, then
concatenated them into one flat buffer per dtype, and the worker received each whole: three
copies of the model on the host of each rank at once (about 45 GB for a 7B model in bf16).
Here the sender holds two chunks and the receiver one, whatever the model's size; the bytes
arrive exactly (any dtype, chunks that split tensors and elements), and a tensor out of layout
is refused before it is sent.
"""

from __future__ import annotations

import importlib.util
from collections import deque
from pathlib import Path

import pytest
import torch

from microrl.rollout.worker.stream import (
    pack,
    receive_stream,
    send_chunks,
    send_stream,
    tensor_checksum,
    total_bytes,
)


def _live_bytes():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "live_bytes.py"
    spec = importlib.util.spec_from_file_location("benchmarks_live_bytes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveBytes


class Wire:
    """A gloo pair's broadcasts in one process: what the sender sends is queued (copied, as
    the network copies it), and the receiver takes the chunks in order."""

    def __init__(self) -> None:
        self.chunks: deque[torch.Tensor] = deque()
        self.waited = 0

    def broadcast(self, chunk: torch.Tensor):
        self.chunks.append(chunk.clone())
        return self

    def wait(self) -> None:
        self.waited += 1

    def receive(self, chunk: torch.Tensor) -> None:
        sent = self.chunks.popleft()
        assert sent.numel() == chunk.numel()  # the two sides cut the stream alike
        chunk.copy_(sent)


def _model() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and sizes, an odd number of bytes between them."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "layer.weight": torch.randn(64, 64, generator=g),
        "layer.bias": torch.randn(7, generator=g).to(torch.float16),
        "mask": torch.rand(13, generator=g) > 0.5,
        "empty": torch.zeros(0),
        "head": torch.randn(64, 300, generator=g).to(torch.bfloat16),
    }


def _entries(tensors):
    return [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]


@pytest.mark.parametrize("chunk_bytes", [7, 1000, 10**9])
def test_a_streamed_push_arrives_exactly_into_the_workers_tensors(chunk_bytes) -> None:
    source = _model()
    entries = _entries(source)
    target = {n: torch.empty_like(t) for n, t in source.items()}
    wire = Wire()
    sums = send_stream(source.items(), entries, wire.broadcast, chunk_bytes)
    assert len(wire.chunks) == -(-total_bytes(entries) // chunk_bytes)
    receive_stream(target, entries, wire.receive, chunk_bytes)
    assert not wire.chunks
    for name, tensor in source.items():
        assert torch.equal(target[name], tensor), name
        assert sums[name] == tensor_checksum(tensor)


def test_a_packed_push_arrives_in_the_same_chunks() -> None:
    source = _model()
    entries = _entries(source)
    packed = pack(source.items(), entries)
    assert packed.buffer.numel() == total_bytes(entries)
    target = {n: torch.zeros_like(t) for n, t in source.items()}
    wire = Wire()
    send_chunks(packed.buffer, wire.broadcast, 1000)
    receive_stream(target, entries, wire.receive, 1000)
    assert all(torch.equal(target[n], t) for n, t in source.items())
    assert packed.checksums == {n: tensor_checksum(t) for n, t in source.items()}


def test_each_side_holds_at_most_its_chunks_not_the_model() -> None:
    LiveBytes = _live_bytes()
    g = torch.Generator().manual_seed(1)
    source = {f"layers.{i}.weight": torch.randn(128, 128, generator=g) for i in range(16)}
    entries = _entries(source)
    model = total_bytes(entries)  # 1 MiB
    chunk = model // 16
    target = {n: torch.empty_like(t) for n, t in source.items()}
    wire = Wire()
    sent = []

    def broadcast(part):  # the sender's side alone: nothing kept here
        sent.append(part.numel())
        return wire

    with LiveBytes() as sender:
        send_stream(source.items(), entries, broadcast, chunk)
    assert sum(sent) == model
    # Two chunk buffers and one tensor's float64 checksum slices (a whole-layout copy: 1.0).
    assert sender.peak <= 2 * chunk + 2 * 8 * 128 * 128 + 1024, sender.peak / model
    assert sender.peak < 0.6 * model
    wire.chunks.extend(torch.ones(n, dtype=torch.uint8) for n in sent)
    with LiveBytes() as receiver:
        receive_stream(target, entries, wire.receive, chunk)
    assert receiver.peak <= chunk + 1024, receiver.peak / model


def test_a_tensor_out_of_layout_is_refused() -> None:
    source = _model()
    entries = _entries(source)
    wrong = {**source, "layer.bias": source["layer.bias"].float()}
    with pytest.raises(
        RuntimeError,
        match=r"changed since the worker started.*expected layer.bias \(7,\) torch.float16",
    ):
        send_stream(wrong.items(), entries, Wire().broadcast, 100)
    with pytest.raises(RuntimeError, match="more tensors than the layout has"):
        pack([*source.items(), ("extra", torch.zeros(1))], entries)
    target = {n: torch.empty_like(t) for n, t in source.items()}
    target["layer.weight"] = torch.empty(64, 64).t()  # bytes would land in a copy
    with pytest.raises(RuntimeError, match=r"layer\.weight in place"):
        receive_stream(target, entries, Wire().receive, 100)
