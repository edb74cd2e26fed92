"""Full weights into a ``vllm serve`` on the trainer's own GPU: vLLM's CUDA-IPC engine over JSON.

A server beside its trainer process (the default placement, docs/async.md#vllm-servers)
cannot join an NCCL group with it: NCCL refuses two ranks of one communicator on one GPU
("Duplicate GPU detected"). vLLM's ``ipc`` weight-transfer engine is made for this case: the
trainer packs the tensors into one CUDA buffer and hands the server a CUDA IPC handle of it, and
the server's worker maps the same memory and loads from it (vLLM's layerwise reload, as for
NCCL). Over HTTP vLLM sends those handles pickled, which its server only reads with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: anyone reaching the route could then run code in it.
The backend :data:`~microrl.rollout.vllm_plugin.transfer.IPC_BACKEND` (a vLLM plugin, with
``gloo``) is vLLM's engine with the handles as plain JSON instead (:func:`encode_handles`: the
arguments of torch's ``rebuild_cuda_tensor``, classes from a fixed list, bytes in base64), so
the server never unpickles anything. Both ends are vLLM's classes; only the encoding of ``/update_weights`` is
microrl's (the trainer's ``_PostClient`` encodes, the worker's ``parse_update_info`` decodes).
Packed (one reusable buffer, sized to at least the largest tensor), so a push holds one buffer
and one gathered tensor on the GPU at a time. CUDA only; this machine's tests cover the encoding
and the registration, not a transfer.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
from typing import Any, ClassVar

import torch

from microrl.rollout.vllm_plugin.transfer import IPC_BACKEND

__all__ = ["decode_update_info", "encode_handles", "encode_update_info"]

# torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments, in order, as
# reduce_tensor makes them for a CUDA tensor, with how each travels in JSON.
_ARGS = (
    ("tensor_cls", "class"),
    ("tensor_size", "ints"),
    ("tensor_stride", "ints"),
    ("tensor_offset", "int"),
    ("storage_cls", "class"),
    ("dtype", "dtype"),
    ("storage_device", "int"),
    ("storage_handle", "bytes"),
    ("storage_size_bytes", "int"),
    ("storage_offset_bytes", "int"),
    ("requires_grad", "bool"),
    ("ref_counter_handle", "bytes"),
    ("ref_counter_offset", "int"),
    ("event_handle", "bytes"),
    ("event_sync_required", "bool"),
)
# The only classes a handle may name (what reduce_tensor gives for a plain CUDA tensor).
_CLASSES = {
    "torch.Tensor": torch.Tensor,
    "torch.nn.Parameter": torch.nn.Parameter,
    "torch.TypedStorage": torch.TypedStorage,
    "torch.UntypedStorage": torch.UntypedStorage,
}
_CLASS_NAMES = {cls: name for name, cls in _CLASSES.items()}


def _encode_arg(kind: str, value: Any) -> Any:
    if kind == "class":
        if value not in _CLASS_NAMES:
            raise ValueError(f"a CUDA IPC handle names class {value!r}, not one of {_CLASSES}")
        return _CLASS_NAMES[value]
    if kind == "ints":
        return [int(v) for v in value]
    if kind == "dtype":
        return str(value).removeprefix("torch.")
    if kind == "bytes":
        return None if value is None else base64.b64encode(bytes(value)).decode("ascii")
    return bool(value) if kind == "bool" else int(value)


def _decode_arg(kind: str, name: str, value: Any) -> Any:
    if kind == "class":
        if value not in _CLASSES:
            raise ValueError(f"IPC handle field {name!r}: class {value!r} is not allowed")
        return _CLASSES[value]
    if kind == "ints":
        return torch.Size(int(v) for v in value) if name == "tensor_size" else tuple(value)
    if kind == "dtype":
        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"IPC handle field {name!r}: unknown dtype {value!r}")
        return dtype
    if kind == "bytes":
        try:
            return None if value is None else base64.b64decode(value, validate=True)
        except (binascii.Error, TypeError) as err:
            raise ValueError(f"IPC handle field {name!r}: not base64 ({err})") from None
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"IPC handle field {name!r}: expected a bool, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"IPC handle field {name!r}: expected an int, got {value!r}")
    return value


def encode_handles(handles: dict | list[dict]) -> dict | list[dict]:
    """vLLM's IPC handles (``{gpu_uuid: rebuild_cuda_tensor args}``, one dict or a list) as
    JSON: each args tuple a dict of its named, plain values."""
    if isinstance(handles, list):
        return [encode_handles(h) for h in handles]
    out = {}
    for uuid, args in handles.items():
        if len(args) != len(_ARGS):
            raise ValueError(
                f"a CUDA IPC handle has {len(args)} fields, this torch's rebuild_cuda_tensor "
                f"{len(_ARGS)}"
            )
        out[str(uuid)] = {
            name: _encode_arg(kind, v) for (name, kind), v in zip(_ARGS, args, strict=True)
        }
    return out


def decode_handles(data: dict | list[dict]) -> dict | list[dict]:
    """:func:`encode_handles`'s inverse; a ``ValueError`` for any field or class it does not
    allow (the server decodes what a client sent)."""
    if isinstance(data, list):
        return [decode_handles(d) for d in data]
    if not isinstance(data, dict):
        raise ValueError(f"IPC handles must be a JSON object, got {type(data).__name__}")
    out = {}
    for uuid, fields in data.items():
        if not isinstance(fields, dict) or set(fields) != {name for name, _ in _ARGS}:
            raise ValueError(f"IPC handle of GPU {uuid!r}: expected the fields of {_ARGS}")
        out[uuid] = tuple(_decode_arg(kind, name, fields[name]) for name, kind in _ARGS)
    return out


def encode_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
    """An ``/update_weights`` ``update_info`` with its ``ipc_handles`` as JSON
    (``ipc_handles_json``); one without handles (another backend's) unchanged."""
    if update_info.get("ipc_handles") is None:
        return update_info
    out = {k: v for k, v in update_info.items() if k not in ("ipc_handles", "ipc_handles_pickled")}
    out["ipc_handles_json"] = encode_handles(update_info["ipc_handles"])
    return out


def decode_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
    """:func:`encode_update_info`'s inverse: the fields of vLLM's ``IPCWeightTransferUpdateInfo``."""
    out = dict(update_info)
    if "ipc_handles_json" in out:
        out["ipc_handles"] = decode_handles(out.pop("ipc_handles_json"))
    return out


def __getattr__(name: str) -> Any:
    if name in _VLLM_CLASSES:
        value = _vllm_classes()[name]
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_VLLM_CLASSES = (
    "JsonIPCWeightTransferEngine",
    "JsonIPCTrainerInitInfo",
    "JsonIPCTrainerWeightTransferEngine",
)


@functools.cache
def _vllm_classes() -> dict[str, type]:
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerInitInfo,
        IPCTrainerWeightTransferEngine,
        IPCWeightTransferEngine,
    )

    class JsonIPCWeightTransferEngine(IPCWeightTransferEngine):
        """vLLM's IPC engine, its handles read from JSON (``ipc_handles_json``)."""

        def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
            return super().parse_update_info(decode_update_info(update_dict))

    @dataclass
    class JsonIPCTrainerInitInfo(IPCTrainerInitInfo):
        """vLLM's IPC trainer init info under this backend's name, packed by default."""

        backend: ClassVar[str] = IPC_BACKEND
        packed: bool = True

    class JsonIPCTrainerWeightTransferEngine(IPCTrainerWeightTransferEngine):
        """vLLM's IPC trainer engine for one trainer process and its own server: its buffer
        grown to the largest tensor of a push (vLLM refuses a tensor larger than the buffer;
        its size is the trainer's alone), and no collective on the default process group.

        vLLM's engine assumes the default group is the set of trainer ranks colocated with
        *one* server, and all-gathers the IPC handles over it (plus barriers) per chunk. In
        microrl each data rank pushes to its own server alone (every rank under data
        parallelism; an sp group's first process under sequence parallelism, while the
        group's others only join the FSDP2 gathers, ``ServerSyncJoiner``): those default-group
        collectives would pair with other ranks' pushes, or, under sequence parallelism, wait
        forever for processes that never make them. So the engine runs as vLLM's does in one
        process: this process's handles only, and the server's answer to each
        ``/update_weights`` (the chunk loaded) is the wait before the buffer is reused."""

        init_info_cls = JsonIPCTrainerInitInfo

        def send_weights(self) -> None:
            largest = max(
                (m.dtype.itemsize * math.prod(m.shape) for m in self.source.metadata()), default=0
            )
            self.packed_buffer_size_bytes = max(self.packed_buffer_size_bytes, largest)
            super().send_weights()

        def _all_gather_and_merge_handles(self, handles: list[dict]) -> list[dict]:
            return handles  # this process's GPU is the server's: nothing to merge

        @staticmethod
        def _post_send_sync() -> None:
            torch.cuda.ipc_collect()  # vLLM's own step, without its default-group barrier

    return {
        "JsonIPCWeightTransferEngine": JsonIPCWeightTransferEngine,
        "JsonIPCTrainerInitInfo": JsonIPCTrainerInitInfo,
        "JsonIPCTrainerWeightTransferEngine": JsonIPCTrainerWeightTransferEngine,
    }
