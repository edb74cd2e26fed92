"""Agent episodes (microrl/agents/runner.py): the real ``openai`` client, sync and async,
streaming and not, against the ``hf`` backend; rows hold exactly the sampled ids and log-probs,
also where re-encoding the text would not; history edits branch; failures and bounds."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from agent_utils import RecordingHF, ScriptedBackend, assert_rows_exact, chat_tokenizer, rows

from microrl.agents import AgentLimits, run_agent_episodes
from microrl.configs.run import TaskConfig
from microrl.rollout import SamplingParams
from microrl.rollout.episodes import EpisodeError
from microrl.tasks import Problem

PROBLEMS = [Problem("1+2=", "3"), Problem("4+5=", "9")]
PARAMS = SamplingParams(num_samples=2, max_new_tokens=3)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def hf(tokenizer):
    return RecordingHF(tokenizer)


def _next(messages: list, reply, observation: str) -> list:
    return [
        *messages,
        reply.model_dump(exclude_none=True),
        {"role": "user", "content": observation},
    ]


async def three_calls_async(client, problem):
    """Three calls: plain (with log-probs), streamed, plain; the reply is checked against them."""
    messages = [{"role": "user", "content": problem.prompt}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, logprobs=True, max_tokens=3
    )
    messages = _next(messages, first.choices[0].message, "no")
    stream = await client.chat.completions.create(model="policy", messages=messages, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    messages = [*messages, {"role": "assistant", "content": text}, {"role": "tool", "content": "7"}]
    await client.chat.completions.create(model="policy", messages=messages)
    return [lp.logprob for lp in first.choices[0].logprobs.content]


def three_calls_sync(client, problem):
    messages = [{"role": "user", "content": problem.prompt}]
    first = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    messages = _next(messages, first.choices[0].message, "no")
    stream = client.chat.completions.create(model="policy", messages=messages, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "a"}]
    client.chat.completions.create(model="policy", messages=messages)
    return [lp.logprob for lp in first.choices[0].logprobs.content]


@pytest.mark.parametrize("agent", [three_calls_async, three_calls_sync])
def test_rows_hold_exactly_the_sampled_ids_and_logprobs(hf, tokenizer, agent):
    hf.calls.clear()
    seen = []

    def reward(result, problem):  # the first call's log-probs, as the client saw them
        seen.append(result)
        return 1.0

    rollout = run_agent_episodes(hf, PROBLEMS, agent, PARAMS, AgentLimits(), reward=reward)
    assert rollout.group_ids.tolist() == [0, 0, 1, 1]  # one row per episode: no branch
    assert rollout.metrics["agent/calls"] == 12 and rollout.metrics["agent/branches"] == 0
    assert assert_rows_exact(rollout, hf.calls, tokenizer.eos_token_id) == 12 == len(hf.calls)
    for (_, mask, lps), client_lps in zip(rows(rollout), seen, strict=True):
        first = [lp for lp, m in zip(lps, mask, strict=True) if m][: len(client_lps)]
        assert first == pytest.approx(client_lps, abs=1e-6)
    assert rollout.num_turns.tolist() == [3] * 4


def test_turns_keep_their_sampled_ids_where_re_encoding_differs(tokenizer):
    one, two, end = (tokenizer.convert_tokens_to_ids(t) for t in ("1", "2", "<|im_end|>"))
    merged = tokenizer.convert_tokens_to_ids("12")
    assert tokenizer("12", add_special_tokens=False)["input_ids"] == [merged]  # the drift
    backend = ScriptedBackend(tokenizer, [[one, two, end]])

    async def agent(client, problem):
        messages = [{"role": "user", "content": problem.prompt}]
        for _ in range(3):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            assert reply.choices[0].message.content == "12"
            messages = _next(messages, reply.choices[0].message, "+")
        return 0.0

    rollout = run_agent_episodes(backend, PROBLEMS[:1], agent, PARAMS.__class__(), AgentLimits())
    ((ids, mask, _),) = rows(rollout)
    assert merged not in ids and ids.count(one) == 3 + 1  # the prompt "1+2=" has one
    assert sum(mask) == 9 and assert_rows_exact(rollout, backend.calls, end) == 3


def test_a_history_edit_branches_into_exact_rows(tokenizer):
    end = tokenizer.eos_token_id
    backend = ScriptedBackend(tokenizer, [[tokenizer.convert_tokens_to_ids("a"), end]])

    async def agent(client, problem):
        ask = client.chat.completions.create
        messages = [{"role": "user", "content": problem.prompt}]
        first = await ask(model="policy", messages=messages)
        longer = _next(messages, first.choices[0].message, "b")
        await ask(model="policy", messages=longer)  # extends the row
        await ask(model="policy", messages=[{"role": "user", "content": "summary"}])  # a rewrite
        await asyncio.gather(*(ask(model="policy", messages=longer) for _ in range(2)))
        return 1.0

    rollout = run_agent_episodes(backend, PROBLEMS[:1], agent, SamplingParams(), AgentLimits())
    # the row, the rewrite, and the two calls repeating the second call's history: the row went
    # on past it, so each starts a row from its recorded ids up to turn 1
    assert rollout.metrics["agent/branches"] == 3 and len(rows(rollout)) == 4
    assert assert_rows_exact(rollout, backend.calls, end) == 5 == len(backend.calls)
    assert len(set(rollout.batch["episode_id"].tolist())) == 1  # one episode, one advantage
    assert "policy_version" not in rollout.batch  # sampled by the trainer's own weights


def test_agent_failures_name_the_episode_or_are_dropped(tokenizer):
    end = tokenizer.eos_token_id
    backend = ScriptedBackend(tokenizer, [[tokenizer.convert_tokens_to_ids("a")] * 3 + [end]])

    async def agent(client, problem):
        messages = [{"role": "user", "content": problem.prompt}]
        await client.chat.completions.create(model="policy", messages=messages)
        if problem.answer == "3":
            raise KeyError("the tool crashed")
        return 1.0

    with pytest.raises(EpisodeError, match=r"episode p0-s0-0 \(problem 0\) raised KeyError"):
        run_agent_episodes(backend, PROBLEMS, agent, PARAMS, AgentLimits())
    kept = run_agent_episodes(backend, PROBLEMS, agent, PARAMS, AgentLimits(skip_errors=True))
    assert kept.group_ids.tolist() == [1, 1] and kept.metrics["agent/errors"] == 2

    async def hangs(client, problem):
        await asyncio.sleep(30)

    def hangs_sync(client, problem):
        time.sleep(30)

    for slow in (hangs, hangs_sync):
        start = time.perf_counter()
        past = (
            r"ran past task.agent.timeout_s=0.3: raise .* or lower task.agent.max_concurrency=256"
        )
        with pytest.raises(EpisodeError, match=past):
            run_agent_episodes(backend, PROBLEMS[:1], slow, PARAMS, AgentLimits(timeout_s=0.3))
        assert time.perf_counter() - start < 10

    async def long_talk(client, problem):
        messages = [{"role": "user", "content": problem.prompt}]
        for _ in range(5):
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages = _next(messages, reply.choices[0].message, "+")
        return 1.0

    with pytest.raises(EpisodeError, match=r"p0-s0-0 exceeded its token budget"):
        run_agent_episodes(backend, PROBLEMS[:1], long_talk, PARAMS, AgentLimits(max_tokens=8))

    async def silent(client, problem):
        return 1.0

    with pytest.raises(EpisodeError, match="returned without calling the model"):
        run_agent_episodes(backend, PROBLEMS[:1], silent, PARAMS, AgentLimits())


class SlowBackend(ScriptedBackend):
    def _sample(self, prompt_ids, params):
        time.sleep(0.5)
        return super()._sample(prompt_ids, params)


def test_episode_clients_share_one_pool_and_time_out_naming_the_keys(tokenizer):
    """A client per episode built an SSL context each (tens of ms of the agents' event loop):
    a step's 1024 episodes at once stalled it past openai's 5 s connect timeout. The clients
    now share one pool, time out at task.agent.timeout_s, and a timeout names what to change."""
    backend = ScriptedBackend(tokenizer, [[tokenizer.eos_token_id]])
    clients = []

    async def agent(client, problem):
        clients.append(client)
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        return 1.0

    def agent_sync(client, problem):
        clients.append(client)
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        return 1.0

    for played in (agent, agent_sync):
        clients.clear()
        run_agent_episodes(backend, PROBLEMS, played, PARAMS, AgentLimits(timeout_s=42.0))
        assert len(clients) == 4 and {c.timeout for c in clients} == {42.0}
        assert len({id(c._client) for c in clients}) == 1  # openai's http client: one pool

    async def impatient(client, problem):
        fast = client.with_options(timeout=0.05)  # the agent's own, shorter timeout
        await fast.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])

    slow = SlowBackend(tokenizer, [[tokenizer.eos_token_id]])
    hint = r"APITimeoutError.*\(a call to the endpoint timed out: raise task.agent.timeout_s=9"
    with pytest.raises(EpisodeError, match=hint):
        run_agent_episodes(slow, PROBLEMS[:1], impatient, PARAMS, AgentLimits(timeout_s=9))


def test_concurrent_episodes_are_batched_and_bounded(tokenizer):
    backend = ScriptedBackend(tokenizer, [[tokenizer.eos_token_id]])
    running, peak = [0], [0]

    async def agent(client, problem):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}]
        )
        running[0] -= 1
        return 1.0

    params = SamplingParams(num_samples=3)
    assert AgentLimits().max_concurrency == TaskConfig().agent.max_concurrency == 256  # bounded
    run_agent_episodes(backend, PROBLEMS, agent, params, AgentLimits(batch_window_s=5.0))
    assert peak[0] == 6 and backend.batches[0] == 6  # every waiting call in one generate
    backend.batches.clear()
    peak[0] = 0
    run_agent_episodes(backend, PROBLEMS, agent, params, AgentLimits(max_concurrency=2))
    assert peak[0] == 2 and max(backend.batches) <= 2


def test_greedy_evaluation_accepts_the_agents_own_temperature(tokenizer):
    backend = ScriptedBackend(tokenizer, [[tokenizer.eos_token_id]])

    def agent(client, problem):
        ask = client.chat.completions.create
        ask(model="policy", messages=[{"role": "user", "content": "x"}], temperature=0)
        return 1.0

    greedy = SamplingParams(greedy=True)
    rollout = run_agent_episodes(backend, PROBLEMS, agent, greedy, AgentLimits())
    assert rollout.rewards.tolist() == [1.0, 1.0]
    with pytest.raises(EpisodeError, match="BadRequestError"):  # sampling: the run's only
        run_agent_episodes(backend, PROBLEMS, agent, SamplingParams(), AgentLimits())


def test_turns_end_at_every_turn_terminator_of_the_backend(tokenizer):
    """A turn ends at any of the backend's ``stop_token_ids`` (its template's turn end, eos and
    ``generation_config.eos_token_id``'s list), not only at the tokenizer's eos."""
    a, hash_, b = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "#", "b"))
    backend = ScriptedBackend(tokenizer, [[a, hash_, b]])
    backend.stop_token_ids = (*backend.stop_token_ids, hash_)  # as generation_config's list adds
    finishes = []

    async def agent(client, problem):
        messages = [{"role": "user", "content": problem.prompt}]
        reply = await client.chat.completions.create(model="policy", messages=messages)
        finishes.append(reply.choices[0].finish_reason)
        return 0.0

    rollout = run_agent_episodes(backend, PROBLEMS[:1], agent, SamplingParams(), AgentLimits())
    ((ids, mask, _),) = rows(rollout)
    assert finishes == ["stop"]
    assert ids[-2:] == [a, hash_] and b not in ids and sum(mask) == 2


def test_an_abandoned_sync_agent_ends_quietly_after_the_runner_closed(tokenizer, monkeypatch):
    """A plain-function agent past its timeout is abandoned; when it returned after the runner
    had closed its loop, its thread raised 'Event loop is closed' (seen in CI's warnings)."""
    backend = ScriptedBackend(tokenizer, [[tokenizer.eos_token_id]])
    raised: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    finished = threading.Event()

    def late(client, problem):
        time.sleep(0.6)
        finished.set()
        return 1.0

    with pytest.raises(EpisodeError, match=r"ran past task\.agent\.timeout_s=0\.2"):
        run_agent_episodes(backend, PROBLEMS[:1], late, PARAMS, AgentLimits(timeout_s=0.2))
    assert finished.wait(5)
    time.sleep(0.2)  # the thread settles after its agent returned
    assert raised == []
