"""Weights from the trainer into ``vllm serve`` processes, through vLLM's weight-transfer API.

How it works, in full: docs/async.md#the-weight-transfer-plugin-wire-protocol-and-failures.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


#: The backend of microrl's CUDA-IPC engine, for a server on the trainer's own GPU
#: (:mod:`microrl.remote.vllm_plugin.ipc`).
IPC_BACKEND = "microrl_ipc"
BACKENDS = ("gloo", "nccl", IPC_BACKEND)
DEFAULT_TIMEOUT_S = 300.0
_GRACE_S = 2.0  # how long a failed server call waits for this side's half of the group op

# The classes that subclass vLLM's are defined on first use (module __getattr__ below), so that
# importing this module, as vLLM's plugin loader does in every process, imports nothing heavy.
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
    "WeightPusher",
    "is_loopback",
    "register",
    *_VLLM_CLASSES,
]


def register() -> None:
    """Register the ``"gloo"`` engines in vLLM's worker and trainer factories (idempotent).

    vLLM calls it in each of its processes as the ``microrl_gloo_weight_transfer`` general
    plugin; ``WeightPusher`` calls it in the trainer. Does nothing when vLLM is not installed.
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:
        return
    ipc = "microrl.remote.vllm_plugin.ipc"
    for factory, name, module, class_name in (
        (WeightTransferEngineFactory, "gloo", __name__, "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, "gloo", __name__, "GlooTrainerWeightTransferEngine"),
        (WeightTransferEngineFactory, IPC_BACKEND, ipc, "JsonIPCWeightTransferEngine"),
        (WeightTransferTrainerFactory, IPC_BACKEND, ipc, "JsonIPCTrainerWeightTransferEngine"),
    ):
        # ValueError: registered already (by an earlier call in this process).
        with contextlib.suppress(ValueError):
            factory.register_engine(name, module, class_name)


def __getattr__(name: str) -> Any:
    if name in _VLLM_CLASSES:
        value = _vllm_classes()[name]
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- transport
class _GlooGroup:
    """The trainer<->workers group: a ``ProcessGroupGloo`` on its own ``TCPStore``."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float, address: str):
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [_gloo_device(address)]
        self.store = store
        self.rank = rank
        self.group = ProcessGroupGloo(store, rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast a contiguous ``tensor``'s bytes from rank ``src`` (in place elsewhere)."""
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
    """Whether ``address`` (a host name or IP) is this machine's loopback."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _store(address: str, port: int, *, master: bool, world_size: int, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(
        address,
        port,
        world_size,
        is_master=master,
        timeout=timedelta(seconds=timeout_s),
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

    Each blocks until the other side has joined. The first error is raised as soon as it
    happens (the server's, which names the route, ahead of this side's), and ``TimeoutError``
    after ``timeout_s``, without waiting on the other thread. The exception carries
    ``local_done`` (whether this side's half completed: if not, the group is out of step).
    """
    post_future = _in_thread(post, f"microrl-{route.strip('/')}")
    local_future = _in_thread(local, f"microrl-{route.strip('/')}-group")
    done, _ = wait([post_future, local_future], timeout=timeout_s, return_when=FIRST_EXCEPTION)
    if post_future in done and post_future.exception() is not None and local_future not in done:
        # A server that rejected what it received has still drained the round (the gloo
        # engine does): this side's half completes right away then, and the group is in step.
        done |= wait([local_future], timeout=min(_GRACE_S, timeout_s)).done
    local_done = local_future in done and local_future.exception() is None
    error: BaseException | None = None
    if post_future in done and post_future.exception() is not None:
        error = post_future.exception()
    elif local_future in done and local_future.exception() is not None:
        err = local_future.exception()
        error = RuntimeError(f"{route}: the weight-transfer group failed: {err}")
        error.__cause__ = err
    elif len(done) < 2:
        waiting = "the server" if post_future not in done else "the weight-transfer group"
        error = TimeoutError(f"{route}: no answer from {waiting} within {timeout_s:g} s")
    if error is not None:
        error.local_done = local_done  # type: ignore[attr-defined]
        raise error
    return local_future.result()


# ----------------------------------------------------------------------------- vLLM's classes
@functools.cache
def _vllm_classes() -> dict[str, type]:
    from dataclasses import asdict, dataclass

    import torch
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
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
        """vLLM's dense NCCL engine over a private gloo group (see the module docstring).

        Inherited: the update info (names, dtype names, shapes), ``start_weight_update`` /
        ``finish_weight_update`` (vLLM's layerwise reload) and ``shutdown``.
        """

        init_info_cls = GlooWeightTransferInitInfo

        def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
            self.shutdown()  # a new trainer replaces the previous one's group
            # Ranks as vLLM's NCCL engine numbers them: unique across data-parallel replicas.
            parallel = self.parallel_config
            worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
            store = _store(
                init_info.master_address,
                init_info.master_port,
                master=False,
                world_size=init_info.world_size,
                timeout_s=init_info.timeout_s,
            )
            self.model_update_group = _GlooGroup(
                store,
                worker_rank + init_info.rank_offset,
                init_info.world_size,
                init_info.timeout_s,
                init_info.master_address,
            )

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            # vLLM's base synchronises unconditionally, which raises where there is no
            # accelerator (the CPU build); a GPU server's copies into its weights are async.
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            group = self.model_update_group
            if group is None:
                raise RuntimeError(
                    "gloo weight transfer is not initialised: POST /init_weight_transfer_engine "
                    "first"
                )
            # vLLM's worker ends the update on an error without finishing it, and a layer left
            # waiting in the layerwise reload would serve meta tensors: on an error the reload
            # is closed here, so the layers loaded keep their new values, the others their old.
            try:
                failure = self._receive_and_load(group, update_info)
            except BaseException:
                # The trainer is gone or out of step: drop its group (the next round needs a
                # new one, not a wait for broadcasts that never come).
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

        def _receive_and_load(
            self, group: _GlooGroup, update_info: NCCLWeightTransferUpdateInfo
        ) -> tuple[str, Exception] | None:
            """Receive every tensor of the round, loading each; the first load error is
            returned, not raised: the rest is still received, so the trainer's broadcasts
            complete and the group stays in step for the next round."""
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )

            dtypes = []
            for name, dtype_name in zip(update_info.names, update_info.dtype_names, strict=True):
                dtype = getattr(torch, dtype_name, None)
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"weight {name!r}: unknown dtype name {dtype_name!r}")
                dtypes.append(dtype)
            failure: tuple[str, Exception] | None = None
            with disable_mtp_completeness_check():
                for name, dtype, shape in zip(
                    update_info.names, dtypes, update_info.shapes, strict=True
                ):
                    weight = torch.empty(shape, dtype=dtype, device="cpu")
                    group.broadcast(weight, src=0)
                    if failure is None:
                        try:
                            self.model.load_weights([(name, weight)])
                        except Exception as err:
                            failure = (name, err)
            return failure

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """Trainer-side init info of the ``"gloo"`` engine (``master_port`` 0: a free port)."""

        backend: ClassVar[str] = "gloo"

        master_address: str
        master_port: int
        world_size: int
        timeout_s: float = DEFAULT_TIMEOUT_S

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        """Trainer side of the ``"gloo"`` engine: rank 0 serves the store and broadcasts."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client: Any, source: Any, is_sender: bool, timeout_s: float):
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.timeout_s = timeout_s
            self.model_update_group: _GlooGroup | None = None
            # False once a failed round left the group out of step with the workers.
            self.in_step = True

        @classmethod
        def trainer_init(
            cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None
        ) -> GlooTrainerWeightTransferEngine:
            if source is None:
                raise ValueError("gloo trainer weight transfer requires a WeightSource.")
            engine = cls(
                client=client,
                source=source,
                is_sender=init_info.is_sender,
                timeout_s=init_info.timeout_s,
            )
            if not engine.is_sender:
                return engine
            store = _store(
                init_info.master_address,
                init_info.master_port,
                master=True,
                world_size=init_info.world_size,
                timeout_s=init_info.timeout_s,
            )
            worker_info = GlooWeightTransferInitInfo(
                master_address=init_info.master_address,
                master_port=store.port,
                rank_offset=1,
                world_size=init_info.world_size,
                timeout_s=init_info.timeout_s,
            )
            engine.model_update_group = _together(
                lambda: client.init_weight_transfer_engine(asdict(worker_info)),
                lambda: _GlooGroup(
                    store, 0, init_info.world_size, init_info.timeout_s, init_info.master_address
                ),
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
                for _, tensor in NCCLTrainerWeightTransferEngine._checked_iter(self.source, meta):
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

        def shutdown(self) -> None:
            if self.model_update_group is not None:
                self.model_update_group.destroy()
                self.model_update_group = None

    return {
        "GlooWeightTransferInitInfo": GlooWeightTransferInitInfo,
        "GlooWeightTransferEngine": GlooWeightTransferEngine,
        "GlooTrainerInitInfo": GlooTrainerInitInfo,
        "GlooTrainerWeightTransferEngine": GlooTrainerWeightTransferEngine,
    }


def _weight_source_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightSource

    class _PushSource(WeightSource):
        """The tensors of the current push: its declared metadata (vLLM ``ParamMeta``s) and a
        fresh pass over its pairs on each iteration (checked against the metadata as they come,
        so a lazy stream is never materialised)."""

        def __init__(self) -> None:
            self.meta: list[Any] = []
            self.iterate: Callable[[], Iterator[tuple[str, torch.Tensor]]] = lambda: iter(())

        def metadata(self) -> list[Any]:
            return self.meta

        def __iter__(self):
            return self.iterate()

    return _PushSource


# ----------------------------------------------------------------------------- trainer side
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
        from microrl.remote.vllm_plugin.ipc import encode_update_info

        # CUDA IPC handles as JSON, never pickled (microrl.remote.vllm_plugin.ipc).
        if isinstance(update_info, list):
            update_info = [encode_update_info(info) for info in update_info]
        else:
            update_info = encode_update_info(update_info)
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self.post("/finish_weight_update", None if version is None else {"weight_version": version})

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("/shutdown_weight_transfer_engine", None)


def _free_port(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


class WeightPusher:
    """Pushes full weights from this process into a ``vllm serve`` process's workers.

    ``backend`` is the server's ``--weight-transfer-config`` backend: ``"nccl"`` (CUDA tensors
    on this process's current device; vLLM's own trainer engine), :data:`IPC_BACKEND` (the same,
    for a server on that very GPU; vLLM's IPC trainer engine) or ``"gloo"`` (CPU tensors;
    ``GlooTrainerWeightTransferEngine``). ``post(route, json_body)`` POSTs to the server
    (``route`` like ``"/update_weights"``; ``json_body`` a dict or None) and raises on an HTTP
    error, naming the route and the server's message; it may return anything. ``world_size``
    is 1 + the server's workers (TP x PP x DP). ``master_address`` is this process's address
    as the server's workers reach it; ``master_port`` the rendezvous port (0: a free one).
    ``timeout_s`` bounds (gloo) the group's operations and each wait on the server; with nccl,
    vLLM's engine keeps its own waits. Pause the server around pushes when requests may be
    running (module docstring).

    ``start()``, then ``push(named_tensors, version)`` as often as needed, then ``close()``
    (or use it as a context manager). Wire protocol: the module docstring.
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

    # -- lifecycle
    def trainer_init_info(self) -> Any:
        """The vLLM ``TrainerInitInfo`` that ``start()`` hands to vLLM's trainer factory."""
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            port = self.master_port or _free_port(self.master_address)
            return NCCLTrainerInitInfo(self.master_address, port, self.world_size, rank=0)
        register()
        if self.backend == IPC_BACKEND:
            from microrl.remote.vllm_plugin.ipc import JsonIPCTrainerInitInfo

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

        source = _weight_source_class()()
        self._engine = WeightTransferTrainerFactory.trainer_init(
            self.trainer_init_info(), client=self._client, source=source
        )
        self._source = source
        self._broken = None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send every ``(name, tensor)`` (checkpoint names, e.g. ``model.layers.0.mlp.up_proj.weight``)
        and make ``version`` the server's weight version.

        Give the whole model as a checkpoint holds it, tied weights under each name (e.g.
        ``model.state_dict().items()``; the module docstring says why). Names the server's model
        does not have, or tensors it cannot load, raise the server's ``/update_weights`` error
        naming the first one. Tensors must be on the backend's device (gloo: CPU; nccl and IPC:
        the current CUDA device). ``named_tensors`` with a ``metadata()`` method (``(name, dtype,
        shape)`` of each pair, in order) is iterated lazily, each pair checked against it as it
        comes, so the caller can produce one tensor at a time (:class:`~microrl.engine.rollout.full_weights.FullWeights`).
        """
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
            self._source.meta = self._checked_metadata(named_tensors.metadata())
            self._source.iterate = lambda: self._checked_stream(named_tensors)
        else:
            pairs = self._checked(named_tensors)
            self._source.meta = self._checked_metadata(
                [(name, t.dtype, tuple(t.shape)) for name, t in pairs]
            )
            self._source.iterate = lambda: iter(pairs)
        self._client.version = str(version)
        try:
            self._engine.send_weights()
        except BaseException as err:
            # The gloo engine knows whether the group is still in step (it is after a tensor the
            # server rejected: the worker drains the round); after vLLM's NCCL engine fails,
            # assume it is not.
            if not getattr(self._engine, "in_step", False):
                self._broken = f"{type(err).__name__}: {err}"
            raise
        finally:
            # Hold no references to the caller's tensors.
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

    # -- input checks
    def _checked(self, named_tensors: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
        pairs: list[tuple[str, Any]] = []
        seen: set[str] = set()
        for item in named_tensors:
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise TypeError(f"push(): expected (name, tensor) pairs, got {item!r:.80}")
            name, tensor = item
            if not isinstance(name, str) or not name:
                raise TypeError(f"push(): a weight name must be a non-empty str, got {name!r}")
            if name in seen:
                raise ValueError(f"push(): weight {name!r} appears twice")
            seen.add(name)
            pairs.append((name, self._checked_tensor(name, tensor)))
        if not pairs:
            raise ValueError("push(): no weights given")
        return pairs

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
        """vLLM ``ParamMeta``s of ``(name, dtype, shape)`` entries (or objects with those
        attributes): non-empty, each name once."""
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
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"push(): weight {name!r} has dtype {dtype!r}, not a torch.dtype")
            seen.add(name)
            meta.append(ParamMeta(name, dtype, tuple(int(s) for s in shape)))
        if not meta:
            raise ValueError("push(): no weights given")
        return meta

    def _checked_stream(self, stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``stream``'s pairs, each checked against the metadata declared for this push as it
        comes (the workers sized their buffers from it) and on the backend's device."""
        meta, count = self._source.meta, 0
        for name, tensor in stream:
            tensor = self._checked_tensor(name, tensor)
            expected = meta[count] if count < len(meta) else None
            if expected is None or (name, tensor.dtype, tuple(tensor.shape)) != (
                expected.name,
                expected.dtype,
                expected.shape,
            ):
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
