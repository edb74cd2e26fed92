"""The trainer's side of a full-weight push into a ``vllm serve`` process: :class:`WeightPusher`
(protocol and failures: :mod:`microrl.rollout.vllm_plugin.transfer`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from microrl.rollout.samplers.vllm_options import free_port as _free_port
from microrl.rollout.vllm_plugin.transfer import (
    BACKENDS,
    DEFAULT_TIMEOUT_S,
    IPC_BACKEND,
    _vllm_classes,
    register,
)

if TYPE_CHECKING:
    import torch

__all__ = ["WeightPusher"]


class _PostClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the caller's ``post(route, json_body)``."""

    def __init__(self, post: Callable[[str, dict | None], Any]):
        self.post = post
        self.version: str | None = None  # sent by finish_weight_update (vLLM's engines pass none)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", None)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        from microrl.rollout.vllm_plugin.ipc import encode_update_info

        # CUDA IPC handles as JSON, never pickled (microrl.rollout.vllm_plugin.ipc).
        self.post("/update_weights", {"update_info": encode_update_info(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self.post("/finish_weight_update", None if version is None else {"weight_version": version})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("/shutdown_weight_transfer_engine", None)


class WeightPusher:
    """Pushes full weights from this process into a ``vllm serve`` process's workers:
    ``start()``, ``push()`` as often as needed, ``close()`` (or a ``with`` block).

    ``backend``: the server's ``--weight-transfer-config`` backend: ``"nccl"``, :data:`IPC_BACKEND`
    (CUDA tensors) or ``"gloo"`` (CPU). ``post(route, json_body)`` raises on an HTTP error.
    ``world_size``: 1 + the server's workers (TP x PP x DP); ``master_port`` 0: a free one.
    """

    def __init__(
        self,
        backend: str,
        post: Callable[[str, dict | None], Any],
        *,
        world_size: int = 2,
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if backend not in BACKENDS:
            raise ValueError(
                f"unknown weight-transfer backend {backend!r}: expected one of {BACKENDS}"
            )
        if not callable(post):
            raise TypeError(f"post must be callable, got {type(post).__name__}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ValueError(
                f"world_size must be an int >= 2 (the trainer + 1 worker or more), got {world_size!r}"
            )
        if not isinstance(master_port, int) or not 0 <= master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {master_port!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.backend = backend
        self.world_size = world_size
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = float(timeout_s)
        self.version: int | None = None  # the last version pushed
        self._client = _PostClient(post)
        self._engine: Any = None
        self._source: Any = None
        self._broken: str | None = None

    def trainer_init_info(self) -> Any:
        """The vLLM ``TrainerInitInfo`` ``start()`` hands to vLLM's trainer factory."""
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            port = self.master_port or _free_port(self.master_address)
            return NCCLTrainerInitInfo(self.master_address, port, self.world_size, rank=0)
        register()
        if self.backend == IPC_BACKEND:
            from microrl.rollout.vllm_plugin.ipc import JsonIPCTrainerInitInfo

            return JsonIPCTrainerInitInfo(rank=0)
        return _vllm_classes()["GlooTrainerInitInfo"](
            self.master_address, self.master_port, self.world_size, self.timeout_s, rank=0
        )

    def start(self) -> None:
        """Join the server's workers in a new transfer group (``/init_weight_transfer_engine``)."""
        if self._engine is not None:
            raise RuntimeError("WeightPusher.start(): started already")
        if self.backend != "gloo":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"WeightPusher backend {self.backend!r} needs a CUDA device in this process "
                    "(vLLM's NCCL and IPC transfer engines); on a CPU, serve with "
                    '--weight-transfer-config \'{"backend":"gloo"}\' and push with '
                    "backend='gloo'"
                )
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        source = _vllm_classes()["_PushSource"]()
        self._engine = WeightTransferTrainerFactory.trainer_init(
            self.trainer_init_info(), client=self._client, source=source
        )
        self._source = source
        self._broken = None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send the whole model's ``(name, tensor)`` pairs on the backend's device as ``version``;
        with a ``metadata()`` (as ``FullWeights``) they stream one tensor at a time."""
        if self._engine is None:
            raise RuntimeError("WeightPusher.push(): call start() first")
        if self._broken is not None:
            raise RuntimeError(
                f"WeightPusher.push(): the transfer group is out of step after an earlier "
                f"failure ({self._broken}); close() this pusher and start a new one"
            )
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {version!r}")
        if callable(getattr(named_tensors, "metadata", None)):  # lazy: one tensor at a time
            metadata, stream = named_tensors.metadata(), named_tensors
        else:  # each pair's tensor checked here, its name by _checked_metadata
            stream = [self._checked_pair(item) for item in named_tensors]
            metadata = [(name, t.dtype, tuple(t.shape)) for name, t in stream]
        self._source.meta = self._checked_metadata(metadata)
        self._source.iterate = lambda: self._checked_stream(stream)
        self._client.version = str(version)
        try:
            self._engine.send_weights()
        except BaseException as err:
            # gloo knows whether the group is still in step; after NCCL fails, assume not.
            if not getattr(self._engine, "in_step", False):
                self._broken = f"{type(err).__name__}: {err}"
            raise
        finally:
            self._source.meta, self._source.iterate = [], lambda: iter(())
        self.version = version

    def close(self) -> None:
        """Release the server's side (best effort: the server may be gone) and this side."""
        engine, self._engine, self._source = self._engine, None, None
        if engine is None:
            return
        try:
            if self._broken is None:
                self._client.shutdown_weight_transfer_engine()
        except Exception:
            pass  # the server is gone or busy; its group dies with the trainer's store
        finally:
            engine.shutdown()

    def __enter__(self) -> WeightPusher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _checked_pair(self, item: Any) -> tuple[Any, Any]:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise TypeError(f"push(): expected (name, tensor) pairs, got {item!r:.80}")
        return item[0], self._checked_tensor(item[0], item[1])

    def _checked_tensor(self, name: str, tensor: Any) -> Any:
        import torch

        device = "cpu" if self.backend == "gloo" else "cuda"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"push(): weight {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type != device:
            raise ValueError(
                f"push(): weight {name!r} is on {tensor.device}; the {self.backend} backend "
                f"sends {device} tensors"
            )
        return tensor.detach()

    @staticmethod
    def _checked_metadata(entries: Iterable[Any]) -> list[Any]:
        """vLLM ``ParamMeta``s of ``(name, dtype, shape)`` entries: non-empty, each name once."""
        import torch
        from vllm.distributed.weight_transfer.base import ParamMeta

        meta, seen = [], set()
        for entry in entries:
            name, dtype, shape = (
                (entry.name, entry.dtype, entry.shape) if hasattr(entry, "name") else entry
            )
            if not isinstance(name, str) or not name:
                raise TypeError(f"push(): a weight name must be a non-empty str, got {name!r}")
            if name in seen:
                raise ValueError(f"push(): weight {name!r} appears twice")
            seen.add(name)
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"push(): weight {name!r} has dtype {dtype!r}, not a torch.dtype")
            meta.append(ParamMeta(name, dtype, tuple(int(s) for s in shape)))
        if not meta:
            raise ValueError("push(): no weights given")
        return meta

    def _checked_stream(self, stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``stream``'s pairs, each checked against the declared metadata as it comes."""
        from vllm.distributed.weight_transfer.base import ParamMeta

        meta, count = self._source.meta, 0
        for name, tensor in stream:
            tensor = self._checked_tensor(name, tensor)
            expected = meta[count] if count < len(meta) else None
            if expected != ParamMeta(name, tensor.dtype, tuple(tensor.shape)):
                raise ValueError(
                    f"push(): the stream yielded {name!r} {tensor.dtype} "
                    f"{tuple(tensor.shape)} where its metadata() declared "
                    f"{'nothing more' if expected is None else expected}"
                )
            count += 1
            yield name, tensor
            del tensor
        if count != len(meta):
            raise ValueError(f"push(): the stream yielded {count} of {len(meta)} weights")
