"""Routing replay from the ``hf`` sampler (docs/recipes.md#routing-replay): ``HFRollout`` with
``record_routing`` lays each token's experts out as the rows' ``routed_experts`` (prompt left
padding and what was generated past a stop: -1), the key survives merging and checkpoints, and
replaying it makes the trainer route as the sampler did (``router/agreement``, ``mismatch/*``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from moe_utils import (
    NUM_LAYERS,
    TOP_K,
    forced_router_forward,
    router_modules,
    tiny_moe,
    whole_forward_routes,
)

from microrl.configs import ActorConfig, OptimConfig
from microrl.configs.run import RolloutConfig
from microrl.engine import ActorEngine
from microrl.engine.moe import ROUTED_EXPERTS_KEY
from microrl.rollout import HFRollout, SamplingParams, make_sampler
from microrl.rollout.merge import merge_rollouts
from microrl.run.source import _rollout_from_plain, _rollout_to_plain
from microrl.run.toy_model import build_tokenizer

PROMPTS = ["1+2=", "34+56=", "7="]
PARAMS = SamplingParams(num_samples=2, max_new_tokens=6, seed=3)


def _policy(tok):
    """A float64 Qwen3-MoE on the toy tokenizer's vocabulary (routing decisive, fp64: the
    cached steps of ``generate`` route exactly as one forward over the rows)."""
    return tiny_moe("qwen3_moe", dtype=torch.float64, vocab_size=len(tok)).eval()


def test_rows_carry_the_experts_of_every_token_they_fed():
    tok = build_tokenizer()
    model = _policy(tok)
    rollout = HFRollout(model, tok, record_routing=True).generate(PROMPTS, PARAMS)
    batch = rollout.batch
    routes, real = batch[ROUTED_EXPERTS_KEY], batch["attention_mask"]
    assert routes.shape == (*real.shape, NUM_LAYERS, TOP_K) and routes.dtype == torch.int16
    assert (routes[~real] == -1).all()  # prompt padding, response padding past each stop
    # Every real token but a row's last (sampled, maybe never fed back) was routed.
    last = real.long().cumsum(1).argmax(1)
    fed = real.clone()
    fed[torch.arange(len(fed)), last] = False
    assert (routes[fed] >= 0).all()
    expected = whole_forward_routes(model, batch)
    assert torch.equal(routes[fed], expected[fed])
    # Merged with a wider rollout (prompts shift right): the key moves with its tokens, -1 pads.
    other = HFRollout(model, tok, record_routing=True).generate(["123+456="], PARAMS)
    merged = merge_rollouts([rollout, other], pad_token_id=tok.pad_token_id)
    m_routes, m_real = merged.batch[ROUTED_EXPERTS_KEY], merged.batch["attention_mask"]
    assert (m_routes[~m_real] == -1).all()
    assert torch.equal(m_routes[: len(routes)][m_real[: len(routes)]], routes[real])
    # A checkpointed round (RolloutSource.state_dict) keeps it.
    restored = _rollout_from_plain(_rollout_to_plain(rollout))
    assert torch.equal(restored.batch[ROUTED_EXPERTS_KEY], routes)


def _flips_near_ties(model, scale: float) -> None:
    """``model``'s routers choose their top-k from noisy logits (as another engine's numerics
    flip near-tied experts), with the family's gate weights over the chosen ones."""
    for router in router_modules(model):

        def forward(hidden, router=router):
            flat = hidden.reshape(-1, router.weight.shape[1])
            logits = torch.nn.functional.linear(flat, router.weight)
            chosen = (logits + scale * torch.randn_like(logits)).topk(TOP_K, dim=-1).indices
            return forced_router_forward(router, chosen)(hidden)

        router.forward = forward


def test_replay_removes_the_mismatch_of_a_sampler_routing_elsewhere():
    """The sampler's routers pick other experts for some tokens than the trainer's would (same
    weights; near ties flipped, as vLLM's kernels do): ``router/agreement`` < 1, measured with
    the trainer's own router, so the same with replay on or off. Without replay the trainer
    computes those tokens through other experts and its log-probs differ from the sampler's;
    replaying the recorded experts runs the sampler's very computation (no mismatch left)."""
    tok = build_tokenizer()
    trainer_model = _policy(tok)
    sampler_model = copy.deepcopy(trainer_model)
    _flips_near_ties(sampler_model, scale=0.5)
    params = SamplingParams(num_samples=4, max_new_tokens=8, seed=5)
    batch = HFRollout(sampler_model, tok, record_routing=True).generate(PROMPTS, params).batch
    metrics = {}
    for replay in (False, True):
        config = ActorConfig(routing_replay=replay, micro_batch_size=4, optim=OptimConfig())
        engine = ActorEngine(copy.deepcopy(trainer_model), config)
        result = engine.forward_backward_batch(batch, loss_fn=engine.sft_loss, forward_only=True)
        metrics[replay] = result["metrics"]
    agreement = {replay: m["router/agreement"] for replay, m in metrics.items()}
    assert 0.5 < agreement[False] < 0.95 and agreement[True] == pytest.approx(agreement[False])
    # The routing the forward used: the sampler's for every token under replay only.
    routed = {replay: m["router/routed_as_sampled"] for replay, m in metrics.items()}
    assert routed == {True: 1.0, False: pytest.approx(agreement[False])}
    assert metrics[False]["mismatch/abs_diff_max"] > 1e-3, metrics[False]
    # fp64 forwards; the sampler's log-probs are stored as float32 (~2e-7 apart at |logp| ~ 3).
    assert metrics[True]["mismatch/abs_diff_max"] < 1e-6, metrics[True]
    for name in ("mismatch/abs_diff_mean", "mismatch/kl_k3"):
        assert metrics[True][name] < 1e-3 * metrics[False][name], (name, metrics)


def test_a_dense_policy_or_another_backend_is_refused_naming_the_key():
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model

    tok = build_tokenizer()
    dense = build_model(ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1), tok)
    with pytest.raises(ValueError, match=r"rollout\.routing_replay.*no mixture-of-experts"):
        HFRollout(dense, tok, record_routing=True)
    engine = ActorEngine(dense, ActorConfig())
    with pytest.raises(ValueError, match=r"rollout\.routing_replay"):
        make_sampler(engine, tok, RolloutConfig(routing_replay=True), version=0)
    moe = ActorEngine(_policy(tok), ActorConfig())
    with pytest.raises(ValueError, match=r"rollout\.routing_replay.*rollout\.backend=vllm"):
        make_sampler(moe, tok, RolloutConfig(routing_replay=True, backend="vllm"), version=0)


def test_episode_rows_carry_the_routing_of_their_last_turn():
    """Multi-turn rows: each turn re-reads the whole context, so a row's routing is its last
    turn's (its context's prefill, then its response); the observation after it has none."""
    from microrl.tasks import HintedAdditionTask, Problem

    tok = build_tokenizer()
    model = _policy(tok)
    task = HintedAdditionTask(max_operand=99, eval_size=10)
    problems = [Problem("12+7=", "19"), Problem("45+45=", "90")]
    rollout = HFRollout(model, tok, record_routing=True).run_episodes(
        [p.prompt for p in problems],
        lambda i: task.make_env(problems[i]),
        SamplingParams(num_samples=2, max_new_tokens=4, seed=0),
        max_turns=3,
        max_tokens=20,
    )
    batch = rollout.batch
    assert rollout.num_turns.max() > 1
    routes, real = batch[ROUTED_EXPERTS_KEY], batch["attention_mask"]
    recorded = routes[..., 0] >= 0  # [B, T, L]
    assert not (recorded & ~real[..., None]).any()
    expected = whole_forward_routes(model, batch)
    assert torch.equal(routes[recorded.all(-1)], expected[recorded.all(-1)])
    cols = torch.arange(real.shape[1])
    last_sampled = torch.where(batch["loss_mask"], cols, -1).max(1).values
    before = real & (cols < last_sampled[:, None])
    assert recorded.all(-1)[before].all()


def test_the_worker_records_and_its_probe_catches_permuted_experts(monkeypatch):
    """``rollout.max_staleness > 0``: the ``hf`` worker's rows carry the routing too. A full
    push whose fused experts arrive permuted (the expert axis of ``gate_up_proj`` rolled: a
    layout mismatch, SkyRL #1680's class) keeps every per-tensor checksum (sums are
    permutation-invariant) but not the probe's log-probs: the sync check fails, nothing samples
    (or trains) through it."""
    from hf_worker_utils import stale_bytes

    from microrl.configs import LoraConfig
    from microrl.rollout.sampler import SamplerOptions
    from microrl.rollout.samplers.hf_worker import AsyncRollout
    from microrl.rollout.weights.sync_check import SyncCheckError

    tok = build_tokenizer()
    model = tiny_moe("qwen3_moe", vocab_size=len(tok))
    engine = ActorEngine(model, ActorConfig(lora=LoraConfig(rank=0)))
    with AsyncRollout(engine, tok, SamplerOptions(record_routing=True)) as worker:
        rollout = worker.generate(PROMPTS, PARAMS)
        here = HFRollout(engine, tok, record_routing=True).generate(PROMPTS, PARAMS)
        routes, real = rollout.batch[ROUTED_EXPERTS_KEY], rollout.batch["attention_mask"]
        assert (routes[~real] == -1).all() and torch.equal(
            rollout.batch["input_ids"], here.batch["input_ids"]
        )
        assert (routes == here.batch[ROUTED_EXPERTS_KEY]).float().mean() > 0.98  # fp32, 2 processes
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert name in [entry for entry, _, _ in worker._layouts["trainable"]]
        weight = dict(engine.model.named_parameters())[name].detach()
        broadcast = AsyncRollout._broadcast

        def permuted(self, buffer, chunk_bytes):
            return broadcast(self, stale_bytes(self, buffer, name, weight.roll(1, 0)), chunk_bytes)

        monkeypatch.setattr(AsyncRollout, "_broadcast", permuted)
        worker.sync(engine)
        with pytest.raises(SyncCheckError, match=r"rollout\.sync_check_tol"):
            worker.generate(PROMPTS, PARAMS)
