"""Every way into the ranks puts rank ``LOCAL_RANK`` on GPU ``LOCAL_RANK``, with a default group
that takes host tensors too.

Simulated torchrun on 4 GPUs (this is rank 3) with CUDA and the process group monkeypatched: the
examples' ``Dist.init()`` then the engine's initialiser, the engine's initialiser alone, and a
group the caller initialised without choosing a device must all select ``cuda:3``. Before one
initialiser owned this, ``Dist.init()`` created the NCCL group on the current device and the
engine, finding the group initialised, skipped ``set_device``: every rank ran on GPU 0. The group
is created with ``cpu:gloo,cuda:nccl``: with NCCL alone the recipes' host-side sums failed ("No
backend type associated with device type cpu"). ``device="cuda"`` is rank 3's GPU too, by index
(a bare "cuda" is GPU 0 in a spawned worker), and a rank with no GPU of its own is refused, as is
a hf generation worker left on the current device.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from microrl.configs import EngineConfig
from microrl.engine import setup
from microrl.engine.parallel import distributed
from microrl.run import Dist

LOCAL_RANK, WORLD, GPUS = 3, 4, 4
BACKEND = "cpu:gloo,cuda:nccl"


class FakeCudaAndGroup:
    """CUDA with ``GPUS`` devices and a process group, as torchrun's rank ``LOCAL_RANK`` sees them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, visible: int, initialized: bool):
        self.current, self.initialized, self.backends = 0, initialized, []
        for key, value in dict(
            RANK=LOCAL_RANK, LOCAL_RANK=LOCAL_RANK, WORLD_SIZE=WORLD, LOCAL_WORLD_SIZE=WORLD
        ).items():
            monkeypatch.setenv(key, str(value))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)
        monkeypatch.setattr(dist, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(dist, "init_process_group", self._init_process_group)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: LOCAL_RANK)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
        # The real teardown would run at the test process's exit.
        monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)

    def _set_device(self, device) -> None:
        self.current = device.index if isinstance(device, torch.device) else int(device)

    def _init_process_group(self, backend, **kwargs) -> None:
        # NCCL binds the group to the current device when it is created: record which.
        self.backends.append((backend, self.current))
        self.initialized = True


def _engine_device() -> torch.device:
    """What ``Engine.__init__`` does first: join the ranks, then resolve ``device="auto"``."""
    distributed.init_distributed()
    return setup.resolve_device(EngineConfig())


def test_the_examples_entry_point_puts_each_rank_on_its_own_gpu(monkeypatch) -> None:
    fake = FakeCudaAndGroup(monkeypatch, visible=GPUS, initialized=False)
    info = Dist.init()
    assert (info.rank, info.world_size) == (LOCAL_RANK, WORLD)
    assert fake.backends == [(BACKEND, LOCAL_RANK)], "the NCCL group was created on another GPU"
    assert _engine_device() == torch.device("cuda", LOCAL_RANK)
    assert fake.current == LOCAL_RANK and len(fake.backends) == 1


def test_the_engine_alone_puts_each_rank_on_its_own_gpu(monkeypatch) -> None:
    fake = FakeCudaAndGroup(monkeypatch, visible=GPUS, initialized=False)
    assert _engine_device() == torch.device("cuda", LOCAL_RANK)
    assert fake.backends == [(BACKEND, LOCAL_RANK)] and fake.current == LOCAL_RANK


def test_a_group_initialised_by_the_caller_still_gets_its_own_gpu(monkeypatch) -> None:
    fake = FakeCudaAndGroup(monkeypatch, visible=GPUS, initialized=True)
    assert _engine_device() == torch.device("cuda", LOCAL_RANK)
    assert fake.backends == [] and fake.current == LOCAL_RANK


def test_one_visible_gpu_per_rank_uses_that_gpu(monkeypatch) -> None:
    # A launcher other than torchrun that sets CUDA_VISIBLE_DEVICES per rank (SLURM's
    # --gpus-per-task=1): LOCAL_RANK 3 sees one GPU, index 0.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    fake = FakeCudaAndGroup(monkeypatch, visible=1, initialized=False)
    assert _engine_device() == torch.device("cuda", 0)
    assert fake.backends == [(BACKEND, 0)]


def test_a_single_process_on_the_cpu_has_no_group(monkeypatch) -> None:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.init_distributed() is None
    assert setup.resolve_device(EngineConfig()) == torch.device("cpu")
    assert Dist.init() == Dist()


def test_a_bare_cuda_device_is_this_ranks_gpu(monkeypatch) -> None:
    FakeCudaAndGroup(monkeypatch, visible=GPUS, initialized=False)
    distributed.init_distributed()
    assert setup.resolve_device(EngineConfig(device="cuda")) == torch.device("cuda", LOCAL_RANK)
    assert setup.resolve_device(EngineConfig(device="cuda:1")) == torch.device("cuda", 1)


def test_more_processes_on_a_node_than_gpus_is_refused(monkeypatch) -> None:
    # torchrun --nproc_per_node 4 on a node with 2 GPUs: rank 3 would have shared GPU 0.
    FakeCudaAndGroup(monkeypatch, visible=2, initialized=False)
    with pytest.raises(ValueError, match=r"4 processes on this node .* only 2 GPUs"):
        distributed.init_distributed()
    monkeypatch.setenv("LOCAL_RANK", "1")  # every rank of the node refuses, not only the last
    with pytest.raises(ValueError, match="start at most one process per GPU"):
        setup.resolve_device(EngineConfig())


@pytest.mark.parametrize("local_rank", [0, 1])
def test_torchrun_with_several_processes_on_one_visible_gpu_is_refused(monkeypatch, local_rank):
    # torchrun --nproc_per_node 2 where one GPU is visible: its processes inherit one
    # CUDA_VISIBLE_DEVICES, so both ranks ran on GPU 0 (slowly, or NCCL's "Duplicate GPU").
    FakeCudaAndGroup(monkeypatch, visible=1, initialized=False)
    for key, value in dict(LOCAL_RANK=local_rank, LOCAL_WORLD_SIZE=2, WORLD_SIZE=2).items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun sets it for its processes
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match=r"2 processes on this node .* only 1 GPU is visible"):
        distributed.init_distributed()
    with pytest.raises(ValueError, match="start at most one process per GPU"):
        setup.resolve_device(EngineConfig())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one process on one GPU: fine
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.local_cuda_index() == 0


def test_the_hf_generation_worker_takes_its_gpu_before_building_its_model(monkeypatch) -> None:
    from microrl.rollout.worker import main as worker_main_module

    fake = FakeCudaAndGroup(monkeypatch, visible=GPUS, initialized=False)
    built_on: list[int] = []

    def build(spec):
        built_on.append(fake.current)
        raise RuntimeError("built")

    monkeypatch.setattr(worker_main_module, "_build_model", build)
    spec = worker_main_module.WorkerSpec(
        name="w", model_config=None, lora=None, tokenizer=None, temperature=1.0, probe={},
        store_port=0, timeout_s=1.0, num_threads=0, device=f"cuda:{LOCAL_RANK}",
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="built"):
        worker_main_module._Worker(spec, None, None)
    assert built_on == [LOCAL_RANK]  # a spawned process starts on GPU 0


def test_the_hf_generation_worker_empties_the_cache_after_each_job(monkeypatch) -> None:
    from microrl.rollout.worker import main as worker_main_module

    FakeCudaAndGroup(monkeypatch, visible=GPUS, initialized=False)
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    worker = object.__new__(worker_main_module._Worker)
    worker.spec = types.SimpleNamespace(device="cuda:3", name="w")
    worker.results = types.SimpleNamespace(put=lambda message: None)
    worker.version = 1
    worker.sampler = types.SimpleNamespace(_sample=lambda ids, params: [ids])
    worker._job("sample", 0, 0, ([[1]], None))
    assert emptied == [True]  # its KV cache is the trainer's memory between jobs
