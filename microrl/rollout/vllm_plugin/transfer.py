"""Weights from the trainer into ``vllm serve`` processes, through vLLM's weight-transfer API.

A ``"gloo"`` engine for CPUs and :func:`register`, the vLLM plugin (imports no vLLM). The trainer
joins with ``/init_weight_transfer_engine``, then per push ``/start_weight_update``,
``/update_weights`` while broadcasting, ``/finish_weight_update``. A rejected tensor is the
``/update_weights`` error (the round completes); a failed broadcast breaks the group. The RL
routes are outside vLLM's ``--api-key``: a trusted network only (docs/async.md#vllm-servers).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


#: The backend of microrl's CUDA-IPC engine (:mod:`microrl.rollout.vllm_plugin.ipc`).
IPC_BACKEND = "microrl_ipc"
BACKENDS = ("gloo", "nccl", IPC_BACKEND)
DEFAULT_TIMEOUT_S = 300.0
_GRACE_S = 2.0  # how long a failed server call waits for this side's half of the group op

# Subclasses of vLLM's are built on first use: vLLM's plugin loader imports this everywhere.
_VLLM_CLASSES = (
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferEngine",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
)
__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "IPC_BACKEND",
    "is_loopback",
    "register",
    *_VLLM_CLASSES,
]


def register() -> None:
    """Register microrl's engines in vLLM's factories (idempotent; nothing without vLLM)."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return
    ipc = "microrl.rollout.vllm_plugin.ipc"
    for factory, name, module, class_name in (
        (WeightTransferEngineFactory, "gloo", __name__, "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, "gloo", __name__, "GlooTrainerWeightTransferEngine"),
        (WeightTransferEngineFactory, IPC_BACKEND, ipc, "JsonIPCWeightTransferEngine"),
        (WeightTransferTrainerFactory, IPC_BACKEND, ipc, "JsonIPCTrainerWeightTransferEngine"),
    ):
        with contextlib.suppress(ValueError):  # registered already, by an earlier call
            factory.register_engine(name, module, class_name)


def lazy_classes(module: str, names: tuple[str, ...], build: Callable[[], dict]) -> Callable:
    """A module ``__getattr__`` giving ``build()``'s classes ``names`` on first use."""

    def module_getattr(name: str) -> Any:
        if name in names:
            return build()[name]
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return module_getattr


def torch_dtype(name: Any, what: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``); ``ValueError`` naming ``what`` if none."""
    import torch

    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what}: unknown dtype {name!r}")
    return dtype


class _GlooGroup:
    """The trainer<->workers group of init ``info``: a ``ProcessGroupGloo`` on its ``TCPStore``."""

    def __init__(self, store: Any, info: Any, rank: int):
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=info.timeout_s)
        options._devices = [_gloo_device(info.master_address)]
        self.store = store  # the rendezvous lives as long as the group
        self.group = ProcessGroupGloo(store, rank, info.world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast a contiguous ``tensor``'s bytes from ``src`` (in place elsewhere)."""
        import torch

        self.group.broadcast(tensor.reshape(-1).view(torch.uint8), src).wait()

    def destroy(self) -> None:
        self.group = None
        self.store = None


def _gloo_device(address: str) -> Any:
    from torch.distributed import ProcessGroupGloo

    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return ProcessGroupGloo.create_device(interface=interface.split(",")[0])
    if is_loopback(address):
        return ProcessGroupGloo.create_device(hostname=address)
    return ProcessGroupGloo.create_default_device()


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a host name or IP) is loopback."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _store(info: Any, *, master: bool) -> Any:
    """The ``TCPStore`` rendezvous of ``info``, hosted by the sender (``master``)."""
    from torch.distributed import TCPStore

    return TCPStore(
        info.master_address,
        info.master_port,
        info.world_size,
        is_master=master,
        timeout=timedelta(seconds=info.timeout_s),
        wait_for_workers=False,
    )


def _in_thread(fn: Callable[[], Any], name: str) -> Future:
    """Run ``fn`` on a daemon thread (one left blocked never holds up the interpreter's exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _together(
    post: Callable[[], Any], local: Callable[[], Any], *, route: str, timeout_s: float
) -> Any:
    """Run a server call and this side's half of a collective at once; return ``local()``'s.
    The first error (the server's first) or ``TimeoutError`` carries ``local_done``."""
    post_future = _in_thread(post, f"microrl-{route.strip('/')}")
    local_future = _in_thread(local, f"microrl-{route.strip('/')}-group")
    done, _ = wait([post_future, local_future], timeout=timeout_s, return_when=FIRST_EXCEPTION)
    error = post_future.exception() if post_future in done else None
    if error is not None and local_future not in done:
        # A server that rejected a tensor still drained the round: our half completes at once.
        done |= wait([local_future], timeout=min(_GRACE_S, timeout_s)).done
    local_err = local_future.exception() if local_future in done else None
    if error is None and local_err is not None:
        error = RuntimeError(f"{route}: the weight-transfer group failed: {local_err}")
        error.__cause__ = local_err
    elif error is None and len(done) < 2:
        waiting = "the server" if post_future not in done else "the weight-transfer group"
        error = TimeoutError(f"{route}: no answer from {waiting} within {timeout_s:g} s")
    if error is not None:
        error.local_done = local_future in done and local_err is None  # type: ignore[attr-defined]
        raise error
    return local_future.result()


@functools.cache
def _vllm_classes() -> dict[str, type]:
    from dataclasses import asdict, dataclass

    import torch
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        WeightSource,
        WeightTransferInitInfo,
    )
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerWeightTransferEngine,
        NCCLWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    @dataclass(kw_only=True)
    class GlooWeightTransferInitInfo(WeightTransferInitInfo):
        """Worker-side init info of the ``"gloo"`` engine: NCCL's TCP rendezvous fields."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = DEFAULT_TIMEOUT_S

    class GlooWeightTransferEngine(NCCLWeightTransferEngine):
        """vLLM's dense NCCL engine over a private gloo group: only the transport is ours."""

        init_info_cls = GlooWeightTransferInitInfo

        def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
            self.shutdown()  # a new trainer replaces the previous one's group
            # Ranks as vLLM's NCCL engine numbers them: unique across data-parallel replicas.
            parallel = self.parallel_config
            rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
            store = _store(init_info, master=False)
            self.model_update_group = _GlooGroup(store, init_info, rank + init_info.rank_offset)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            # vLLM's base synchronises unconditionally, which raises on its CPU build.
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, info: NCCLWeightTransferUpdateInfo) -> None:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            group = self.model_update_group
            if group is None:
                raise RuntimeError(
                    "gloo weight transfer is not initialised: POST /init_weight_transfer_engine "
                    "first"
                )
            # The first load error is kept so the round completes (the group stays in step);
            # vLLM then leaves the layerwise reload open (meta tensors): close it here.
            failure: tuple[str, Exception] | None = None
            try:
                dtypes = [
                    torch_dtype(d, f"weight {n!r}")
                    for n, d in zip(info.names, info.dtype_names, strict=True)
                ]
                with disable_mtp_completeness_check():
                    for name, dtype, shape in zip(info.names, dtypes, info.shapes, strict=True):
                        weight = torch.empty(shape, dtype=dtype, device="cpu")
                        group.broadcast(weight, src=0)
                        if failure is None:
                            try:
                                self.model.load_weights([(name, weight)])
                            except Exception as err:
                                failure = (name, err)
            except BaseException:
                # The trainer is gone or out of step: the next round needs a new group.
                self.shutdown()
                finalize_layerwise_reload(self.model, self.model_config)
                raise
            if failure is not None:
                finalize_layerwise_reload(self.model, self.model_config)
                name, err = failure
                raise ValueError(
                    f"the server could not load weight {name!r} "
                    f"({type(err).__name__}: {err}); the weights before it in this update were "
                    "loaded, the rest keep their old values"
                ) from err

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """Trainer-side init info of the ``"gloo"`` engine (``master_port`` 0: a free port)."""

        backend: ClassVar[str] = "gloo"

        master_address: str
        master_port: int
        world_size: int
        timeout_s: float = DEFAULT_TIMEOUT_S

    class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
        """Trainer side of the ``"gloo"`` engine, vLLM's NCCL one over a private gloo group:
        rank 0 serves the store and broadcasts."""

        init_info_cls = GlooTrainerInitInfo
        in_step = True  # False once a failed round left the group out of step with the workers

        @classmethod
        def trainer_init(
            cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None
        ) -> GlooTrainerWeightTransferEngine:
            if source is None:
                raise ValueError("gloo trainer weight transfer requires a WeightSource.")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            engine.timeout_s = init_info.timeout_s
            if not engine.is_sender:
                return engine
            store = _store(init_info, master=True)
            # The workers' GlooWeightTransferInitInfo: at the store's port, ranks after this one.
            worker_info = asdict(init_info) | {"master_port": store.port, "rank_offset": 1}
            del worker_info["rank"]
            engine.model_update_group = _together(
                lambda: client.init_weight_transfer_engine(worker_info),
                lambda: _GlooGroup(store, init_info, 0),
                route="/init_weight_transfer_engine",
                timeout_s=init_info.timeout_s,
            )
            return engine

        def send_weights(self) -> None:
            meta = self.source.metadata()
            if not self.is_sender:
                for _ in self.source:
                    pass
                return
            group = self.model_update_group
            assert group is not None, "trainer_init() must be called before send_weights()"
            update_info = NCCLWeightTransferUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta],
            )

            def broadcast_all() -> None:
                # vLLM's check that iteration matches the metadata the workers were sent.
                for _, tensor in self._checked_iter(self.source, meta):
                    group.broadcast(tensor.detach().contiguous(), src=0)

            self.client.start_weight_update()
            try:
                _together(
                    lambda: self.client.update_weights(asdict(update_info)),
                    broadcast_all,
                    route="/update_weights",
                    timeout_s=self.timeout_s,
                )
            except BaseException as err:
                self.in_step = getattr(err, "local_done", False)
                raise
            self.client.finish_weight_update()

    class _PushSource(WeightSource):
        """The current push: its ``ParamMeta``s and a fresh pass over its pairs per iteration."""

        def __init__(self) -> None:
            self.meta: list[Any] = []
            self.iterate: Callable[[], Iterator[tuple[str, torch.Tensor]]] = lambda: iter(())

        def metadata(self) -> list[Any]:
            return self.meta

        def __iter__(self):
            return self.iterate()

    classes = locals()  # the classes defined above, by name
    return {name: classes[name] for name in (*_VLLM_CLASSES, "_PushSource")}


__getattr__ = lazy_classes(__name__, _VLLM_CLASSES, _vllm_classes)
