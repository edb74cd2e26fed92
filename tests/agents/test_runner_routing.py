"""Routing replay through agent rows (docs/recipes.md#routing-replay): with a sampler recording
the routing, every agent row carries ``routed_experts``, its latest turn's (a call's prompt is
its whole row so far, so that turn's forwards fed every token of it but its last sampled one),
exactly as one forward over the row routes it; branches and both ways of sampling the calls (the
backend's batches, an out-of-process sampler's jobs) included."""

from __future__ import annotations

import threading

import pytest
import torch
from agent_utils import chat_tokenizer
from moe_utils import NUM_LAYERS, TOP_K, tiny_moe, whole_forward_routes

from microrl.agents import AgentLimits, run_agent_episodes
from microrl.agents.runner import play_agents
from microrl.agents.sampler import BatchingSampler
from microrl.engine.moe import ROUTED_EXPERTS_KEY
from microrl.rollout import HFRollout, SamplingParams
from microrl.rollout.samplers.in_process import InProcessSampler
from microrl.tasks import Problem

PROBLEMS = [Problem("1+2=", "3"), Problem("34+56=", "90")]
PARAMS = SamplingParams(num_samples=2, max_new_tokens=3, seed=1)


async def talk_then_rewrite(client, problem):
    """Three calls extending one row (a user and a tool observation between them), then a
    rewritten history: a second row."""
    ask = client.chat.completions.create
    messages = [{"role": "user", "content": problem.prompt}]
    for observation in ("user", "tool"):
        reply = (await ask(model="policy", messages=messages)).choices[0].message
        messages = [*messages, reply.model_dump(exclude_none=True)]
        messages.append({"role": observation, "content": "7"})
    await ask(model="policy", messages=messages)
    await ask(model="policy", messages=[{"role": "user", "content": "ab" + problem.prompt}])
    return 1.0


@pytest.mark.parametrize("calls", ["backend", "jobs"])
def test_agent_rows_carry_the_routing_of_their_latest_turn(calls):
    tok = chat_tokenizer()
    # fp64: the cached steps of generate route exactly as one forward over the rows.
    model = tiny_moe("qwen3_moe", dtype=torch.float64, vocab_size=len(tok)).eval()
    backend = HFRollout(model, tok, record_routing=True)
    if calls == "backend":  # the backend's batched calls, on this thread
        rollout = run_agent_episodes(backend, PROBLEMS, talk_then_rewrite, PARAMS, AgentLimits())
    else:  # as jobs of a sampler (rollout.max_staleness > 0): the routing comes in its rows
        inner = InProcessSampler(backend, None)
        sampler = BatchingSampler.over_async(inner, tok, PARAMS, threading.RLock())
        rollout = play_agents(sampler, PROBLEMS, talk_then_rewrite, PARAMS, AgentLimits())
    batch = rollout.batch
    assert rollout.metrics["agent/branches"] == 4 and rollout.num_turns.max() == 3
    routes, real = batch[ROUTED_EXPERTS_KEY], batch["attention_mask"]
    assert routes.shape == (*real.shape, NUM_LAYERS, TOP_K) and routes.dtype == torch.int16
    recorded = (routes >= 0).all(-1).all(-1)  # [B, T]
    assert ((routes >= 0) == recorded[..., None, None]).all()  # a token has all or none
    assert not (recorded & ~real).any()  # padding: -1
    expected = whole_forward_routes(model, batch)
    assert torch.equal(routes[recorded], expected[recorded])
    # Every token before a row's last sampled one was fed by its latest turn: all recorded,
    # the prompt, earlier turns and the observations between them included.
    cols = torch.arange(real.shape[1])
    last_sampled = torch.where(batch["loss_mask"], cols, -1).max(1).values
    assert (last_sampled == torch.where(real, cols, -1).max(1).values).all()  # nothing after
    assert recorded[real & (cols < last_sampled[:, None])].all()
