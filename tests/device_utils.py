"""Simulated CUDA on a CPU-only torch build, for tests that must fail where a GPU run would.

CI has no GPU, and on a CPU a rollout's host tensors and the engine's outputs share one device,
so a product bug that mixes them (``cuda_output * cpu_mask``) passes every CPU test and fails at
step 1 of a GPU run. Inside :func:`simulated_cuda`:

* ``torch.cuda`` reports ``gpus`` devices; ``set_device`` and ``current_device`` follow each other;
* a tensor made on or moved to a GPU (``torch.zeros(..., device="cuda:1")``, ``.to(device)``,
  ``.cuda()``; ``"cuda"`` alone is the current GPU, as on a GPU) is a plain CPU tensor whose
  storage is *marked* as living on that GPU: ``.device``, ``.is_cuda`` and ``get_device()`` say
  so, and every result of an op on it is marked too;
* every op checks CUDA's device rule on the marks: tensors on two devices raise
  ``RuntimeError("Expected all tensors to be on the same device ...")`` (a 0-dim CPU tensor beside
  GPU ones is allowed, as on a GPU; so are copies between devices and CPU indices into a GPU
  tensor), and ``.numpy()`` of a GPU tensor raises as it does on a GPU.

* pinned host memory (``pin_memory=True`` in a factory call) is plain host memory accounted as
  torch's CUDA host allocator keeps it (:class:`PinnedHost`): blocks rounded up to a power of
  two, a freed one cached for a later request of its size, all cached ones released by
  ``torch.accelerator.empty_host_cache()``.

Values, autograd, optimizers and kernels are the CPU's own, so engines, models and recipes run
unchanged (each op passes through Python: slower). torch's ``FakeTensorMode`` has the same device
rule but no values, which ``.item()``, sampling and metrics need; a wrapper tensor subclass with a
CUDA device cannot run autograd on a CPU-only build (no CUDA device guard). Collectives are
checked by :func:`check_collectives`.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PinnedHost", "Simulation", "check_collectives", "simulated_cuda"]

aten = torch.ops.aten
CPU = torch.device("cpu")

# Ops whose tensors may sit on different devices on a GPU too: copies between devices, and a
# GPU tensor indexed with CPU indices (torch moves the indices).
_CROSS_DEVICE_OPS = {
    aten._to_copy.default,
    aten.copy_.default,
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
}


class PinnedHost:
    """The bytes torch's CUDA host allocator (``CachingHostAllocator``) would hold: each pinned
    tensor takes a block of its bytes rounded up to a power of two; a freed block stays cached
    (still pinned) and serves a later request of the same size class; ``empty_host_cache``
    releases the cached ones."""

    def __init__(self) -> None:
        self.active = 0  # bytes of blocks live tensors use
        self.cached: dict[int, int] = {}  # size class -> free blocks kept pinned

    @property
    def held(self) -> int:
        """Every pinned byte: in use and cached."""
        return self.active + sum(size * count for size, count in self.cached.items())

    def pin(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        size = 1 << max(0, storage.nbytes() - 1).bit_length()
        if self.cached.get(size):
            self.cached[size] -= 1
        self.active += size
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.active -= size
        self.cached[size] = self.cached.get(size, 0) + 1

    def empty_host_cache(self) -> None:
        self.cached.clear()


class Simulation:
    """``gpus`` simulated GPUs: the current one, the GPU each marked CPU storage is on, and
    the pinned host memory (:class:`PinnedHost`)."""

    def __init__(self, gpus: int) -> None:
        self.gpus = gpus
        self.current = 0
        self._marks: dict[int, tuple[StorageWeakRef, torch.device]] = {}
        self.pinned = PinnedHost()

    # ------------------------------------------------------------------ devices
    def normalize(self, device: Any) -> Any:
        """``device`` with ``"cuda"`` resolved to the current GPU; anything else unchanged."""
        if device is None or isinstance(device, int | torch.dtype | torch.Tensor):
            return device
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError):
            return device
        if parsed.type != "cuda":
            return device
        index = self.current if parsed.index is None else parsed.index
        if not 0 <= index < self.gpus:
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (cuda:{index}, {self.gpus} GPUs)"
            )
        return torch.device("cuda", index)

    def set_device(self, device: Any) -> None:
        self.current = device if isinstance(device, int) else self.normalize(device).index

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        """Where ``tensor`` lives in the simulation: its mark, else its real device."""
        if tensor.device.type != "cpu" or tensor.is_sparse:
            return tensor.device
        storage = tensor.untyped_storage()
        entry = self._marks.get(storage._cdata)
        if entry is None:
            return CPU
        if entry[0].expired():  # a new storage at a freed one's address
            del self._marks[storage._cdata]
            return CPU
        return entry[1]

    def mark(self, tensor: torch.Tensor, device: torch.device) -> None:
        storage = tensor.untyped_storage()
        self._marks[storage._cdata] = (StorageWeakRef(storage), device)

    def unmark(self, tensor: torch.Tensor) -> None:
        self._marks.pop(tensor.untyped_storage()._cdata, None)

    def check(self, what: Any, tensors: list[torch.Tensor], cross_device: bool = False):
        """The GPU of ``tensors`` (None when none is on one); raises as CUDA does when they
        sit on several devices (a 0-dim CPU tensor beside GPU ones is fine)."""
        devices = {
            self.device_of(t)
            for t in tensors
            if not (t.dim() == 0 and self.device_of(t).type == "cpu") and t.device.type != "meta"
        }
        gpus = sorted((d for d in devices if d.type == "cuda"), key=str)
        if not gpus:
            return None
        if len(gpus) > 1 or (len(devices) > 1 and not cross_device):
            names = " and ".join(sorted(str(d) for d in devices))
            operands = ", ".join(f"{self.device_of(t)} {t.dtype} {tuple(t.shape)}" for t in tensors)
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{names}! (simulated CUDA, in {what}: {operands})"
            )
        return gpus[0]


class _AtenMode(TorchDispatchMode):
    """Checks each op's devices; the results of ops on (or onto) a GPU are marked."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = _tensors(args) + _tensors(kwargs.values())
        if any(isinstance(t, DTensor) for t in tensors):
            # FSDP2's shards: DTensor's own dispatch runs the op on its local tensors, which
            # come back through this mode (a mode's NotImplemented keeps it active).
            return NotImplemented
        if any(isinstance(t, FakeTensor) for t in tensors):  # torch's own shape propagation
            return func(*args, **kwargs)
        on = self.sim.check(func, tensors, cross_device=func in _CROSS_DEVICE_OPS)
        # A device argument names the GPU to put the result on; "cpu" is ambiguous: C++ fills
        # in the input's real device (``.to(dtype)``, ``empty_like``), so the input's GPU stays
        # (an explicit ``.cpu()`` is answered at the torch level, see _TorchMode._to).
        target = on
        if kwargs.get("device") is not None:
            device = torch.device(self.sim.normalize(kwargs["device"]))
            if device.type == "cuda":
                target, kwargs["device"] = device, CPU
        out = func(*args, **kwargs)
        if target is not None and target.type == "cuda" and not func._schema.is_mutable:
            for tensor in _tensors((out,)):
                self.sim.mark(tensor, target)
        return out


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in ``values``, one level of lists or tuples deep (aten's argument shapes)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, list | tuple):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


class _TorchMode(TorchFunctionMode):
    """``.device`` and friends answer from the marks; ``"cuda"`` means the current GPU."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        sim = self.sim
        if func == torch.Tensor.device.__get__:
            return sim.device_of(args[0])
        if func == torch.Tensor.is_cuda.__get__:
            return sim.device_of(args[0]).type == "cuda"
        if func is torch.Tensor.get_device:
            device = sim.device_of(args[0])
            return -1 if device.type == "cpu" else device.index
        if func is torch.Tensor.numpy and sim.device_of(args[0]).type == "cuda":
            raise TypeError(
                f"can't convert {sim.device_of(args[0])} device type tensor to numpy. Use "
                "Tensor.cpu() to copy the tensor to host memory first."
            )
        if func is torch.Tensor.pin_memory:
            return args[0]  # no page-locked memory on a CPU-only build; a copy's semantics
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch.Tensor.cuda:
            device = args[1] if len(args) > 1 else kwargs.pop("device", None)
            device = torch.device("cuda", sim.current if device is None else device)
            return args[0].to(sim.normalize(device), **kwargs)
        if "device" in kwargs:
            kwargs["device"] = sim.normalize(kwargs["device"])
        if kwargs.get("pin_memory"):  # no page-locked memory here: host memory, accounted
            kwargs["pin_memory"] = False
            out = func(*args, **kwargs)
            sim.pinned.pin(out)
            return out
        if func is torch.Tensor.cpu:
            return self._to(args[0], CPU, None, kwargs)
        if func is torch.histc and not args[0].is_floating_point():
            # CUDA's histc takes integer input (transformers' grouped-mm experts count tokens
            # per expert so on a GPU); the CPU kernel takes floats only.
            counts = func(args[0].float(), *args[1:], **kwargs)
            return counts.to(args[0].dtype)
        if func is torch.Tensor.to:
            device, dtype = _to_target(args[1:], kwargs)
            if device is not None:
                return self._to(args[0], torch.device(sim.normalize(device)), dtype, kwargs)
        return func(*args, **kwargs)

    def _to(self, tensor: torch.Tensor, device: torch.device, dtype, kwargs: dict) -> Any:
        """``tensor.to(device, dtype)`` as on a GPU: the tensor itself when nothing changes, else
        a copy (a GPU tensor's values are CPU ones: torch alone would not copy to the CPU)."""
        dtype = dtype or tensor.dtype
        if self.sim.device_of(tensor) == device and dtype == tensor.dtype:
            return tensor.clone() if kwargs.get("copy") else tensor
        out = aten._to_copy.default(tensor, dtype=dtype, device=device)
        if device.type == "cpu":
            self.sim.unmark(out)
        return out


def _to_target(args: tuple, kwargs: dict) -> tuple[Any, torch.dtype | None]:
    """The device and dtype of a ``Tensor.to`` call (None where it gives none)."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, bool):  # non_blocking, copy
            continue
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, torch.Tensor):
            device, dtype = arg.device, arg.dtype
        elif isinstance(arg, str | torch.device | int):
            device = arg
    return device, dtype


# What torch.cuda.get_device_properties answers (an 80 GiB Hopper-like GPU); autocast asks it.
_PROPERTIES = types.SimpleNamespace(
    name="Simulated GPU", total_memory=80 * 2**30, major=9, minor=0, multi_processor_count=132
)


class _Stream:
    """A stand-in ``torch.cuda.Stream``/``Event``: work is synchronous here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = kwargs.get("device")

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> _Stream:
        return _Stream()

    def __getattr__(self, name: str) -> Any:  # wait_stream, wait_event, synchronize, query...
        return lambda *args, **kwargs: True


@contextlib.contextmanager
def simulated_cuda(monkeypatch: pytest.MonkeyPatch, gpus: int = 1) -> Iterator[Simulation]:
    """Inside the block this CPU-only torch has ``gpus`` simulated GPUs (the module doc)."""
    sim = Simulation(gpus)
    zeros_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)  # noqa: E731
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: sim.gpus,
        "current_device": lambda: sim.current,
        "set_device": sim.set_device,
        "_lazy_init": lambda: None,
        "is_initialized": lambda: True,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "get_device_name": lambda device=None: "Simulated GPU",
        "get_device_properties": lambda device=None: _PROPERTIES,
        "is_bf16_supported": lambda including_emulation=True: True,
        "mem_get_info": lambda device=None: (_PROPERTIES.total_memory, _PROPERTIES.total_memory),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "seed": lambda: None,
        "get_rng_state": zeros_state,
        "set_rng_state": lambda *a, **k: None,
        "get_rng_state_all": lambda: [zeros_state() for _ in range(sim.gpus)],
        "set_rng_state_all": lambda states: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "Stream": _Stream,
        "Event": _Stream,
        "current_stream": lambda device=None: _Stream(device=device),
        "default_stream": lambda device=None: _Stream(device=device),
        "stream": lambda stream=None: contextlib.nullcontext(),
    }
    for name, value in patches.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", sim.pinned.empty_host_cache)
    lift_cpu = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)  # torch.tensor(..., device=cuda): host, then moved
    try:
        with _TorchMode(sim), _AtenMode(sim):
            yield sim
    finally:
        torch._C._set_only_lift_cpu_tensors(lift_cpu)


def check_collectives(monkeypatch: pytest.MonkeyPatch, sim: Simulation) -> list[str]:
    """Make torch.distributed refuse, as on GPUs, a tensor whose (simulated) device has no
    backend in its group: each group's backends are the ones ``init_process_group``/``new_group``
    were *asked* for (``"nccl"``: GPU tensors only; ``"cpu:gloo,cuda:nccl"``: both), and
    ``dist.get_backend`` answers them, while gloo runs every collective here. Returns the
    default group's backends asked for, in order."""
    asked: dict[Any, str] = {}
    requested: list[str] = []
    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, *args, **kwargs):
        requested.append(str(backend))
        init("gloo", *args, **kwargs)
        asked[None] = str(backend)

    def new(*args, backend=None, **kwargs):
        group = new_group(*args, backend="gloo" if backend else None, **kwargs)
        asked[group] = str(backend) if backend else asked.get(None, "gloo")
        return group

    def guarded(name: str):
        real = getattr(dist, name)

        def collective(*args, group=None, **kwargs):
            backend = get_backend(group)
            devices = dist.BackendConfig(backend).get_device_backend_map()
            flat, _ = tree_flatten((args, kwargs))
            for tensor in (t for t in flat if isinstance(t, torch.Tensor)):
                device = sim.device_of(tensor)
                if device.type not in devices:
                    raise RuntimeError(
                        f"No backend type associated with device type {device.type} "
                        f"(simulated: dist.{name} on a group asked for {backend!r})"
                    )
            return real(*args, group=group, **kwargs)

        return collective

    def get_backend(group=None):
        return asked.get(group, asked.get(None, "gloo"))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "new_group", new)
    monkeypatch.setattr(dist, "get_backend", get_backend)
    for name in (
        "all_reduce",
        "broadcast",
        "all_gather",
        "all_gather_into_tensor",
        "barrier",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "gather",
        "scatter",
    ):
        monkeypatch.setattr(dist, name, guarded(name))
    return requested
