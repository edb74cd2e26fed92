"""Full weights into a ``vllm serve`` on the trainer's own GPU (NCCL refuses two ranks on one):
vLLM's IPC engine with its handles as JSON (:func:`encode_handles`), not pickled (a server reads
pickles only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: code execution for any caller)."""

from __future__ import annotations

import base64
import binascii
import functools
import math
from typing import Any, ClassVar

import torch

from microrl.rollout.vllm_plugin.transfer import IPC_BACKEND, lazy_classes, torch_dtype

__all__ = ["decode_update_info", "encode_handles", "encode_update_info"]

# rebuild_cuda_tensor's arguments, in order, with how each travels in JSON.
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
        return torch_dtype(value, f"IPC handle field {name!r}")
    if kind == "bytes":
        try:
            return None if value is None else base64.b64decode(value, validate=True)
        except (binascii.Error, TypeError) as err:
            raise ValueError(f"IPC handle field {name!r}: not base64 ({err})") from None
    if isinstance(value, bool) != (kind == "bool") or not isinstance(value, int):  # bool is an int
        expected = "a bool" if kind == "bool" else "an int"
        raise ValueError(f"IPC handle field {name!r}: expected {expected}, got {value!r}")
    return value


def encode_handles(handles: dict | list[dict]) -> dict | list[dict]:
    """vLLM's IPC handles (``{gpu_uuid: rebuild_cuda_tensor args}``, or a list) as JSON."""
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
    """:func:`encode_handles`'s inverse; ``ValueError`` for a field or class it does not allow."""
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


def encode_update_info(update_info: dict[str, Any] | list[dict]) -> dict[str, Any] | list[dict]:
    """An ``update_info`` (or a list) with its ``ipc_handles`` as JSON (``ipc_handles_json``)."""
    if isinstance(update_info, list):
        return [encode_update_info(info) for info in update_info]
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
        """vLLM's IPC trainer engine for one process and its own server: the buffer grown to
        the largest tensor, no default-group collective (each data rank has its own server)."""

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

    classes = locals()  # the classes defined above, by name
    return {name: classes[name] for name in _VLLM_CLASSES}


__getattr__ = lazy_classes(__name__, _VLLM_CLASSES, _vllm_classes)
