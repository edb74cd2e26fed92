"""Which GPUs the local ``vllm serve`` servers get, and the trainer address their workers reach.

No GPU and no server: CUDA is monkeypatched (``device_count``, torchrun's ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``), and :class:`VLLMServerRollout` starts servers that only record the command
and environment they would run with (``subprocess.Popen`` replaced). Before the placement, no
server got a ``CUDA_VISIBLE_DEVICES``: every server of every rank started on GPU 0. A
distillation teacher's local server (``teacher.backend=vllm``) follows the same rule.
"""

from __future__ import annotations

import subprocess
import tempfile
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from route_utils import ROUTE_ADDRESS, UDPSocket, route_only_socket

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.endpoint import EndpointConfig
from microrl.configs.rollout import VLLMConfig
from microrl.configs.run import RolloutConfig
from microrl.engine import ActorEngine
from microrl.rollout.sampler import SamplerOptions


@pytest.fixture(scope="module")
def tokenizer():
    from microrl.run.toy_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def lora_engine(tokenizer):
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model

    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=0)
    config = ActorConfig(micro_batch_size=8, optim=OptimConfig(lr=1e-2), lora=LoraConfig(rank=8))
    return ActorEngine(build_model(cfg, tokenizer), config)


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """``(command, env)`` of every local server a rollout starts; nothing runs, no weights move."""
    from microrl.rollout.samplers import vllm_launch, vllm_options, vllm_servers

    started = []

    class Process:
        pid, returncode = -1, None  # never signalled: _stop is replaced below

        def poll(self):
            return None

    def popen(command, env, **kwargs):
        started.append((command, env))
        return Process()

    fake_subprocess = SimpleNamespace(
        Popen=popen, STDOUT=subprocess.STDOUT, DEVNULL=subprocess.DEVNULL
    )
    monkeypatch.setattr(vllm_launch, "subprocess", fake_subprocess)
    monkeypatch.setattr(vllm_launch, "_stop", lambda *args: None)
    monkeypatch.setattr(vllm_launch.watcher, "watch", lambda *args, **kwargs: None)  # no pid
    monkeypatch.setattr(vllm_launch.LocalVLLMServer, "_wait_until_up", lambda self, t: None)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the servers' log files
    monkeypatch.setattr(vllm_options, "export_merged_model", lambda *args, **kwargs: None)
    done: Future = Future()
    done.set_result(None)
    monkeypatch.setattr(vllm_servers.VLLMServerRollout, "_submit_sync", lambda *a, **k: done)
    return started


def fake_gpus(monkeypatch, *, count: int, local_rank: int, local_world: int) -> None:
    """CUDA with ``count`` GPUs, as torchrun's local rank ``local_rank`` of ``local_world``
    sees them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: local_rank)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))


def start(engine, tokenizer, tmp_path, monkeypatch, *, device: str, num_workers=1, **config):
    """The servers of a :class:`VLLMServerRollout` whose engine trains on ``device``."""
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout

    monkeypatch.setattr(engine, "device", torch.device(device))
    rollout = VLLMServerRollout(
        engine,
        tokenizer,
        VLLMConfig(**config),
        SamplerOptions(sync_check_tol=1e-4),
        num_workers=num_workers,
        workdir=str(tmp_path),
    )
    rollout.close()


def visible(env: dict[str, str]) -> str | None:
    return env.get("CUDA_VISIBLE_DEVICES")


def test_colocated_servers_of_8_ranks_take_8_gpus(
    lora_engine, tokenizer, tmp_path, monkeypatch, recorded
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for rank in range(8):
        fake_gpus(monkeypatch, count=8, local_rank=rank, local_world=8)
        start(lora_engine, tokenizer, tmp_path, monkeypatch, device=f"cuda:{rank}")
    assert [visible(env) for _, env in recorded] == [str(r) for r in range(8)]
    command = recorded[0][0]
    assert "--tensor-parallel-size" not in command and "uni" not in command  # a GPU server


def test_a_parent_cuda_visible_devices_mapping_is_honoured(
    lora_engine, tokenizer, tmp_path, monkeypatch, recorded
):
    """The trainer sees physical GPUs 4-7 as cuda:0-3: local rank 1's server takes GPU 5, and
    both its servers share it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    fake_gpus(monkeypatch, count=4, local_rank=1, local_world=4)
    start(lora_engine, tokenizer, tmp_path, monkeypatch, device="cuda:1", num_workers=2)
    assert [visible(env) for _, env in recorded] == ["5", "5"]


def test_dedicated_gpus_two_servers_per_rank(
    lora_engine, tokenizer, tmp_path, monkeypatch, recorded
):
    """Two ranks train on cuda:0 and cuda:1; GPUs 4-7 sample, two servers per rank."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for rank in range(2):
        fake_gpus(monkeypatch, count=8, local_rank=rank, local_world=2)
        start(
            lora_engine,
            tokenizer,
            tmp_path,
            monkeypatch,
            device=f"cuda:{rank}",
            num_workers=2,
            gpus="4,5,6,7",
        )
    # A rank's two servers start side by side (in either order): rank 0 takes 4-5, rank 1 6-7.
    gpus = [visible(env) for _, env in recorded]
    assert (sorted(gpus[:2]), sorted(gpus[2:])) == (["4", "5"], ["6", "7"]), gpus


def test_tensor_parallel_servers(lora_engine, tokenizer, tmp_path, monkeypatch, recorded):
    """tp=2 under a parent mapping: rank 1 of 2 takes the second pair of the list."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    fake_gpus(monkeypatch, count=8, local_rank=1, local_world=2)
    start(
        lora_engine,
        tokenizer,
        tmp_path,
        monkeypatch,
        device="cuda:1",
        gpus="4,5,6,7",
        tensor_parallel_size=2,
    )
    ((command, env),) = recorded
    assert visible(env) == "6,7"
    assert command[command.index("--tensor-parallel-size") + 1] == "2"


def test_a_teachers_local_server_is_placed_as_a_rollout_server(monkeypatch, recorded):
    """``teacher.backend=vllm`` without ``teacher.server.url``: each rank's teacher server on
    that rank's GPU, through the parent's mapping. Before, it got no ``CUDA_VISIBLE_DEVICES``:
    every rank's teacher started on GPU 0, and on 8 GPUs the 3rd or 4th failed for memory."""
    from microrl.configs.teacher import TeacherConfig
    from microrl.run.teacher import VLLMTeacher

    config = TeacherConfig(path="teacher-dir", backend="vllm")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for rank in range(8):
        fake_gpus(monkeypatch, count=8, local_rank=rank, local_world=8)
        VLLMTeacher(config, vllm=VLLMConfig(), device=f"cuda:{rank}").close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    fake_gpus(monkeypatch, count=4, local_rank=1, local_world=4)
    VLLMTeacher(config, vllm=VLLMConfig(), device="cuda").close()  # torchrun's cuda:LOCAL_RANK
    assert [visible(env) for _, env in recorded] == [*map(str, range(8)), "5"]
    assert all("uni" not in command for command, _ in recorded)  # GPU servers


def test_a_cpu_trainer_changes_nothing(lora_engine, tokenizer, tmp_path, monkeypatch, recorded):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    start(lora_engine, tokenizer, tmp_path, monkeypatch, device="cpu")
    ((command, env),) = recorded
    assert visible(env) == "3" and "uni" in command  # the parent's, and the CPU set-up


@pytest.mark.parametrize(
    ("device", "config", "error"),
    [
        (
            "cuda:0",
            dict(gpus="4,5,6"),
            r"rollout\.vllm\.gpus='4,5,6' lists 3 GPUs; 2 trainer .*"
            r"rollout\.num_workers=2 .*need 4",
        ),
        (
            "cuda:0",
            dict(gpus="4,5,6,9"),
            r"rollout\.vllm\.gpus='4,5,6,9' lists GPU 9, but this "
            "process sees 8",
        ),
        (
            "cuda:0",
            dict(gpus="1,4,5,6"),
            r"rollout\.vllm\.gpus='1,4,5,6' lists GPU 1, which a "
            "trainer process of this node trains on",
        ),
        (
            "cuda:0",
            dict(tensor_parallel_size=2),
            r"rollout\.vllm\.tensor_parallel_size must be 1 without rollout\.vllm\.gpus",
        ),
        ("cpu", dict(gpus="4,5"), r"rollout\.vllm\.gpus='4,5' .*the trainer runs on cpu"),
    ],
    ids=["too-few", "not-visible", "a-training-gpu", "tp-colocated", "gpus-on-cpu"],
)
def test_placement_errors_name_the_keys(
    lora_engine, tokenizer, tmp_path, monkeypatch, recorded, device, config, error
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake_gpus(monkeypatch, count=8, local_rank=0, local_world=2)
    with pytest.raises(ValueError, match=error):
        start(lora_engine, tokenizer, tmp_path, monkeypatch, device=device, num_workers=2, **config)
    assert recorded == []  # refused before any server started


def test_config_errors_name_the_keys():
    with pytest.raises(ValueError, match=r"vllm\.gpus must list each GPU once \(GPU 4"):
        VLLMConfig(gpus="4,5,4")
    with pytest.raises(ValueError, match=r"vllm\.gpus must list GPU indices"):
        VLLMConfig(gpus="4,cuda:5")
    with pytest.raises(ValueError, match=r"vllm\.tensor_parallel_size must be an int >= 1"):
        VLLMConfig(tensor_parallel_size=0)
    servers = dict(backend="vllm", max_staleness=1)
    assert RolloutConfig(**servers, vllm=VLLMConfig(gpus="2,3", tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"rollout\.vllm\.gpus must be '' unless microrl starts"):
        user_servers = EndpointConfig(url="http://h:8000")
        RolloutConfig(**servers, server=user_servers, vllm=VLLMConfig(gpus="2"))
    with pytest.raises(ValueError, match=r"rollout\.vllm\.gpus must be '' unless microrl starts"):
        RolloutConfig(backend="vllm", vllm=VLLMConfig(gpus="2"))  # the synchronous loop
    with pytest.raises(ValueError, match=r"rollout\.vllm\.tensor_parallel_size must be 1 without"):
        RolloutConfig(**servers, vllm=VLLMConfig(tensor_parallel_size=2))


# ----------------------------------------------------------------------------- trainer address
def test_the_trainer_address_is_the_route_to_the_server(monkeypatch):
    from microrl.rollout.samplers import vllm_placement
    from microrl.rollout.samplers.vllm_placement import trainer_address

    # This module's sockets only.
    monkeypatch.setattr(vllm_placement, "socket", route_only_socket())
    assert trainer_address("http://127.0.0.1:8000") == "127.0.0.1"
    assert trainer_address("http://localhost:8000/") == "127.0.0.1"
    assert UDPSocket.targets == []  # a local server needs no route
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): only the target of the (recorded) connect.
    assert trainer_address("http://192.0.2.10:8000") == ROUTE_ADDRESS
    assert UDPSocket.targets == [("192.0.2.10", 8000)]
    assert trainer_address("http://192.0.2.10:8000", "10.9.9.9") == "10.9.9.9"  # the key wins
    assert len(UDPSocket.targets) == 1


def test_the_servers_of_rollout_server_url_split_by_data_rank(monkeypatch):
    """Data rank ``r`` of ``w`` takes every ``w``-th server from the ``r``-th; under sequence
    parallelism the data rank is the sp group's (the rank in the engine's dp group), so the
    processes of a group name the same servers."""
    from microrl.rollout.samplers import vllm_placement
    from microrl.rollout.samplers.vllm_placement import (
        data_rank,
        pushes_per_sync,
        urls_of_data_rank,
    )

    urls = ["http://a:1", " http://b:2", "http://c:3"]
    assert urls_of_data_rank(urls, 0, 2) == ["http://a:1", "http://c:3"]
    assert urls_of_data_rank(urls, 1, 2) == ["http://b:2"]  # stripped
    assert urls_of_data_rank(urls, 0, 1) == ["http://a:1", "http://b:2", "http://c:3"]
    with pytest.raises(ValueError, match=r"lists 3 servers for 4 data ranks"):
        urls_of_data_rank(urls, 3, 4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        urls_of_data_rank(urls, 2, 2)

    plain = SimpleNamespace(sp_group=None)
    assert data_rank(plain) == (0, 1)  # one process
    assert pushes_per_sync(plain, urls, num_workers=5) == 3  # every server is this rank's
    assert pushes_per_sync(plain, [], num_workers=5) == 5  # local servers: num_workers
    # Processes 2 and 3 of 4 in sp groups of 2: data rank 1 of 2 (the dp group's rank).
    grouped = SimpleNamespace(sp_group="sp", dp_group="dp")
    monkeypatch.setattr(vllm_placement.dist, "get_rank", {"dp": 1}.__getitem__)
    monkeypatch.setattr(vllm_placement.dist, "get_world_size", {"dp": 2}.__getitem__)
    assert data_rank(grouped) == (1, 2)
    assert pushes_per_sync(grouped, urls, num_workers=1) == 2  # data rank 0 pushes to 2


def test_dedicated_gpus_one_block_per_sequence_parallel_group(monkeypatch):
    """4 processes of a node in sp groups of 2 (2 data ranks): the groups' first processes
    (local ranks 0 and 2) take the first and second block, so 2 dedicated GPUs are enough."""
    from microrl.rollout.samplers.vllm_placement import server_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    placed = []
    for rank in (0, 2):
        fake_gpus(monkeypatch, count=8, local_rank=rank, local_world=4)
        device = torch.device("cuda", rank)
        placed += server_gpus(device, num_workers=1, gpus="4,5", group_size=2)
    assert placed == [[4], [5]]
    with pytest.raises(ValueError, match=r"lists 1 GPUs; 2 sequence-parallel group\(s\)"):
        server_gpus(device, num_workers=1, gpus="4", group_size=2)
