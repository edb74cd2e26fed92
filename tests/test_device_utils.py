"""The simulated CUDA of tests/device_utils.py fails where a GPU would, and only there.

The recipe tests on simulated GPUs (tests/examples/test_examples_cuda.py) prove nothing if the
simulation lets a device mix through, so its rules are pinned here: a mix raises, a same-device
op and the moves a GPU allows do not, gradients and optimizers work on simulated GPU tensors, a
collective refuses a host tensor on a group asked for NCCL alone, and pinned host memory is held
as torch's host allocator holds it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device_utils import simulated_cuda
from tensordict import TensorDict

MIX = "Expected all tensors to be on the same device"


def test_a_host_tensor_beside_a_gpu_tensor_raises(monkeypatch) -> None:
    with simulated_cuda(monkeypatch, gpus=2) as sim:
        gpu = torch.arange(4.0, device="cuda")
        assert gpu.device == torch.device("cuda", 0) and gpu.is_cuda
        with pytest.raises(RuntimeError, match=MIX):
            gpu * torch.ones(4)
        with pytest.raises(RuntimeError, match=MIX):
            torch.where(gpu > 1, gpu, torch.zeros(4))
        with pytest.raises(RuntimeError, match=MIX):
            torch.zeros(1, device="cuda:1") + torch.zeros(1, device="cuda:0")
        with pytest.raises(TypeError, match="numpy"):
            gpu.numpy()
        # What a GPU allows: a 0-dim host scalar, CPU indices, moves and .item()/.tolist().
        assert (gpu * torch.tensor(2.0)).sum().item() == 12.0
        assert gpu[torch.tensor([0, 2])].tolist() == [0.0, 2.0]
        assert (gpu + torch.ones(4).to("cuda")).device == torch.device("cuda", 0)
        host = gpu.cpu()
        assert host.device.type == "cpu" and (host * torch.ones(4)).tolist() == [0, 1, 2, 3]
        sim.set_device(1)
        assert torch.zeros(1, device="cuda").device == torch.device("cuda", 1)
        assert torch.ones(1).cuda().device == torch.device("cuda", 1)


def test_models_train_and_tensordicts_move_on_a_simulated_gpu(monkeypatch) -> None:
    with simulated_cuda(monkeypatch):
        layer = torch.nn.Linear(4, 3).to("cuda")
        assert layer.weight.device.type == "cuda"
        layer(torch.randn(2, 4, device="cuda")).square().sum().backward()
        assert layer.weight.grad.device.type == "cuda"
        torch.optim.AdamW(layer.parameters(), lr=0.1).step()
        with pytest.raises(RuntimeError, match=MIX):
            layer(torch.randn(2, 4))  # a host input to a GPU model
        batch = TensorDict(a=torch.ones(2, 3), batch_size=[2]).to(torch.device("cuda", 0))
        assert batch["a"].device.type == "cuda" and batch[torch.tensor([1])]["a"].is_cuda
        assert batch["a"].half().device.type == "cuda"  # a dtype change stays on the GPU


def test_pinned_host_memory_is_cached_until_the_host_cache_is_emptied(monkeypatch) -> None:
    with simulated_cuda(monkeypatch) as sim:
        a = torch.empty(1000, dtype=torch.uint8, pin_memory=True)
        b = torch.empty_like(torch.zeros(300), device="cpu", pin_memory=True)  # 1200 bytes
        assert a.device.type == "cpu" and sim.pinned.held == sim.pinned.active == 1024 + 2048
        del a
        assert sim.pinned.active == 2048 and sim.pinned.held == 1024 + 2048  # cached, pinned
        c = torch.empty(1024, dtype=torch.uint8, pin_memory=True)  # the cached block serves it
        assert sim.pinned.held == 1024 + 2048
        del b, c
        torch.accelerator.empty_host_cache()
        assert sim.pinned.held == 0


# Its own process: a default group another test left (FSDP2 over one rank) would be in the way.
NCCL_GROUP = """
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, sys.argv[1])
from device_utils import check_collectives, simulated_cuda

from microrl.engine.parallel import distributed

monkeypatch = pytest.MonkeyPatch()
with simulated_cuda(monkeypatch) as sim:
    asked = check_collectives(monkeypatch, sim)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    assert asked == ["nccl"] and dist.get_backend() == "nccl"
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2, dtype=torch.float64))
    dist.all_reduce(torch.ones(2, device="cuda"))
    # microrl's reduction takes a host tensor to this rank's GPU and back.
    assert distributed.collective_device("cpu") == torch.device("cuda", 0)
    reduced = distributed.all_reduce(torch.ones(2, dtype=torch.float64))
    assert reduced.device.type == "cpu" and reduced.tolist() == [1.0, 1.0]
    dist.destroy_process_group()
print("ok")
"""


def test_a_collective_refuses_host_tensors_on_a_group_asked_for_nccl() -> None:
    tests = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, "-c", NCCL_GROUP, str(tests)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
