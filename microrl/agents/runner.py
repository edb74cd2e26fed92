"""Run users' agents as episodes: ``agent(client, problem) -> reward`` against the endpoint.

:func:`run_agent_episodes` starts an :class:`~microrl.agents.endpoint.AgentEndpoint` (a thread of
the trainer process), gives each episode an ``openai`` client whose base URL names it, runs the
agents concurrently on an event loop of their own (a plain function runs in a thread with the
synchronous client), samples their calls with the run's backend from the calling thread
(:meth:`~microrl.agents.sampler.BatchingSampler.pump`) and returns the recorded rows as one
:class:`~microrl.rollout.Rollout` in the episodes' layout (docs/rollouts.md#agents).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import itertools
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from microrl.agents.endpoint import AgentEndpoint, EpisodeState
from microrl.agents.sampler import BatchingSampler
from microrl.configs.task import DEFAULT_AGENT_MAX_CONCURRENCY
from microrl.rollout.base import Rollout, RolloutBackend, SamplingParams, episode_rollout
from microrl.rollout.episodes import EpisodeError, ObservationRenderer
from microrl.rollout.sampler import POLICY_VERSION_KEY

__all__ = [
    "AGENT_METRICS",
    "EPISODE_KEY",
    "AgentLimits",
    "agent_metric_means",
    "play_agents",
    "run_agent_episodes",
]

#: The per-row batch key naming the episode a row belongs to (an episode's branches share it).
EPISODE_KEY = "episode_id"
#: ``Rollout.metrics`` an agent rollout carries (sums, so merged rollouts add them up).
AGENT_METRICS = (
    "agent/episodes",
    "agent/calls",
    "agent/tool_calls",
    "agent/tool_parse_errors",
    "agent/branches",
    "agent/time_s",
    "agent/errors",
)


# Episode numbers (the batch's EPISODE_KEY) stay distinct across the rollouts of a process,
# which dynamic sampling merges; a random start keeps a resumed run's apart from its restored.
_EPISODES_PER_CALL = 1 << 20
_EPISODE_NUMBERS = itertools.count(secrets.randbelow(1 << 20) << 10)


@dataclass(frozen=True)
class AgentLimits:
    """An agent episode's bounds: seconds (``timeout_s``), tokens after its first prompt
    (``max_tokens``, per row), episodes running at once (``max_concurrency``, 0: all); with
    ``skip_errors`` a failed episode is dropped instead of stopping the run. ``timeout_s`` is
    also the timeout of each call of the agents' clients."""

    timeout_s: float = 600.0
    max_tokens: int = 1024
    max_concurrency: int = DEFAULT_AGENT_MAX_CONCURRENCY
    skip_errors: bool = False
    host: str = "127.0.0.1"
    batch_window_s: float = 0.02  # how long a batch waits for more calls (hf, colocated vllm)


@dataclass
class _Outcome:
    result: Any = None
    error: str | None = None
    seconds: float = 0.0


def run_agent_episodes(
    backend: RolloutBackend,
    problems: Sequence[Any],
    agent: Callable[[Any, Any], Any],
    params: SamplingParams,
    limits: AgentLimits,
    *,
    reward: Callable[[Any, Any], float] | None = None,
    tool_parser: Any = None,
    version: int | None = None,
) -> Rollout:
    """Play ``params.num_samples`` episodes of ``agent`` per problem; rows grouped by problem.

    ``agent(client, problem)``: an ``async def`` gets an ``openai.AsyncOpenAI``, a plain
    function an ``openai.OpenAI``; it returns the episode's reward, or anything
    ``reward(result, problem)`` scores. An agent that raises, runs past ``limits.timeout_s``,
    exceeds ``limits.max_tokens`` or made no call stops the run with an
    :class:`~microrl.rollout.episodes.EpisodeError` naming the episode, or with
    ``limits.skip_errors`` is dropped (``agent/errors``). Under ``torchrun`` it is collective.
    """
    sampler = BatchingSampler.over_backend(  # TypeError unless a RolloutBackend
        backend, params, version=version, window_s=limits.batch_window_s
    )
    return play_agents(
        sampler, problems, agent, params, limits, reward=reward, tool_parser=tool_parser
    )


def play_agents(
    sampler: BatchingSampler,
    problems: Sequence[Any],
    agent: Callable[[Any, Any], Any],
    params: SamplingParams,
    limits: AgentLimits,
    *,
    reward: Callable[[Any, Any], float] | None = None,
    tool_parser: Any = None,
) -> Rollout:
    """:func:`run_agent_episodes` on any :class:`BatchingSampler`, pumped by the calling
    thread; when its turns carry policy versions (sampled ahead), the rows carry
    ``policy_version`` ``[B]``, the oldest among their sampled tokens (what bounds their
    staleness)."""
    if not callable(agent):
        raise TypeError(f"agent must be callable (client, problem) -> reward, got {agent!r}")
    if importlib.util.find_spec("openai") is None:
        raise ImportError("agents get an openai client: pip install 'microrl[agents]' (openai)")
    endpoint = AgentEndpoint(
        sampler,
        ObservationRenderer(sampler.tokenizer),
        temperature=None if params.greedy else params.temperature,
        max_new_tokens=params.max_new_tokens,
        host=limits.host,
        tool_parser=tool_parser,
    ).start()
    loop = _AgentLoop(limits)
    try:
        names, futures = [], []
        for index, problem in enumerate(problems):
            for sample in range(params.num_samples):
                name = f"p{index}-s{sample}-{len(names)}"
                endpoint.add_episode(name, limits.max_tokens)
                names.append((name, index))
                url = endpoint.base_url(name)
                end = functools.partial(endpoint.end_episode, name)
                futures.append(loop.submit(agent, problem, url, endpoint.api_key, end))
        sampler.pump(lambda: sum(not f.done() for f in futures))
        outcomes = [f.result() for f in futures]
    finally:
        for name in endpoint.episodes:
            endpoint.end_episode(name)
        loop.close()
        endpoint.close()
    return _rollout(sampler.tokenizer, endpoint, names, outcomes, problems, reward, limits)


class _AgentLoop:
    """An event loop on a thread of its own that runs the agents (see the module docstring).

    Every episode's client shares one connection pool (one per client kind): a client of its
    own builds an SSL context, tens of milliseconds of this loop per episode, during which the
    calls already sent wait."""

    def __init__(self, limits: AgentLimits) -> None:
        import openai  # the users' client; imported only when agents run

        self.limits = limits
        self.http = openai.DefaultAsyncHttpxClient(timeout=limits.timeout_s)
        self.sync_http = openai.DefaultHttpxClient(timeout=limits.timeout_s)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        # Bound to the loop it first waits on (Python >= 3.10), the agents'.
        self.gate = asyncio.Semaphore(limits.max_concurrency or 1 << 30)

    def submit(self, agent, problem, url: str, key: str, on_end) -> Future:
        coroutine = self._run(agent, problem, url, key, on_end)
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def _run(self, agent, problem, url: str, key: str, on_end) -> _Outcome:
        async with self.gate:
            start = time.perf_counter()
            outcome = _Outcome()
            try:
                call = self._call(agent, problem, url, key)
                outcome.result = await asyncio.wait_for(call, self.limits.timeout_s)
            except asyncio.TimeoutError:  # not yet the builtin on Python 3.10
                timeout = self.limits.timeout_s
                outcome.error = (
                    f"ran past task.agent.timeout_s={timeout}: {_more_time(self.limits)}"
                )
            except Exception as exc:  # any agent failure is reported the same way
                trace = "".join(traceback.format_exception(exc)).rstrip()
                hint = ""
                if type(exc).__name__ == "APITimeoutError":  # openai's: a call waited too long
                    hint = f" (a call to the endpoint timed out: {_more_time(self.limits)})"
                outcome.error = (
                    f"raised {type(exc).__name__}: {exc}{hint}\nthe agent's traceback:\n{trace}"
                )
            outcome.seconds = time.perf_counter() - start
            on_end()  # its later calls (an abandoned thread's) are refused
            return outcome

    async def _call(self, agent, problem, url: str, key: str) -> Any:
        import openai

        options = dict(base_url=url, api_key=key, max_retries=0, timeout=self.limits.timeout_s)
        if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(
            getattr(agent, "__call__", None)  # noqa: B004 - an instance with an async __call__
        ):
            # Not closed after the episode: closing it would close the shared pool.
            return await agent(openai.AsyncOpenAI(**options, http_client=self.http), problem)
        # A plain function runs in a daemon thread: one past its timeout is abandoned, not
        # joined (its later calls are refused once the episode ended).
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                result = agent(openai.OpenAI(**options, http_client=self.sync_http), problem)
            except BaseException as exc:
                _settle_from_thread(done, None, exc)
            else:
                _settle_from_thread(done, result, None)

        threading.Thread(target=run, daemon=True).start()
        return await done

    def close(self) -> None:
        closing = asyncio.run_coroutine_threadsafe(self.http.aclose(), self.loop)
        with contextlib.suppress(Exception):  # a pool that will not close is dropped
            closing.result(10)
        self.sync_http.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


def _more_time(limits: AgentLimits) -> str:
    """The keys that give a timed-out episode or call more time."""
    return (
        f"raise task.agent.timeout_s={limits.timeout_s} (the episode's and its client's timeout), "
        f"or lower task.agent.max_concurrency={limits.max_concurrency} (0: all of a step's "
        "episodes at once; they share one sampler, so more at once make each call wait longer)"
    )


def _settle_from_thread(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Settle ``future`` from an agent's thread; an abandoned episode's loop may be closed
    by now (the runner closed after its timeout), and then nothing waits for the outcome."""
    with contextlib.suppress(RuntimeError):  # "Event loop is closed"
        future.get_loop().call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _rollout(
    tokenizer, endpoint: AgentEndpoint, names, outcomes, problems, reward, limits
) -> Rollout:
    rows, groups, episodes, rewards, metrics = [], [], [], [], dict.fromkeys(AGENT_METRICS, 0.0)
    first = next(_EPISODE_NUMBERS) * _EPISODES_PER_CALL  # unique among merged rounds
    for number, ((name, index), outcome) in enumerate(zip(names, outcomes, strict=True)):
        state = endpoint.episodes[name]
        kept = state.recorder.trained_rows()
        error = state.error or outcome.error
        if error is None and not kept:
            error = "returned without calling the model"
        if error is None:
            try:
                value = _reward(outcome.result, problems[index], reward)
            except (TypeError, ValueError) as err:
                error = str(err)
        _count(metrics, state, outcome)
        if error is not None:
            if not limits.skip_errors:
                raise EpisodeError(f"the agent of episode {name} (problem {index}) {error}")
            metrics["agent/errors"] += 1
            continue
        rows += kept
        groups += [index] * len(kept)
        episodes += [first + number] * len(kept)
        rewards += [value] * len(kept)
    if not rows:
        raise EpisodeError(
            f"every one of the {len(names)} agent episodes failed "
            "(rollout.skip_env_errors drops failed episodes, but none is left)"
        )
    rollout = episode_rollout(tokenizer, rows, groups, metrics, rewards)
    rollout.batch[EPISODE_KEY] = torch.tensor(episodes, dtype=torch.long)
    if all(None not in r.versions for r in rows):  # sampled ahead: each token's version known
        versions = [min(r.versions) for r in rows]
        rollout.batch[POLICY_VERSION_KEY] = torch.tensor(versions, dtype=torch.long)
    return rollout


def _count(metrics: dict[str, float], state: EpisodeState, outcome: _Outcome) -> None:
    metrics["agent/episodes"] += 1
    metrics["agent/calls"] += state.recorder.calls
    metrics["agent/tool_calls"] += state.tool_calls
    metrics["agent/tool_parse_errors"] += state.tool_parse_errors
    metrics["agent/branches"] += state.recorder.branches
    metrics["agent/time_s"] += outcome.seconds


def _reward(result: Any, problem: Any, reward: Callable | None) -> float:
    if isinstance(result, bool | int | float):
        return float(result)
    if reward is None:
        raise TypeError(f"returned {type(result).__name__}, not a float reward")
    return float(reward(result, problem))


def agent_metric_means(sums: dict[str, float]) -> dict[str, float]:
    """The reported ``agent/*`` metrics from summed counts: per episode where it reads so."""
    episodes = max(sums.get("agent/episodes", 0.0), 1.0)
    rest = {key: sums.get(key, 0.0) for key in AGENT_METRICS[2:]}  # after episodes and calls
    return {"agent/calls_per_episode": sums.get("agent/calls", 0.0) / episodes, **rest}
