"""One model turn per endpoint call, sampled by the run's sampler in batches.

The endpoint's handlers (on the server's event loop) queue calls here; one thread runs
:meth:`BatchingSampler.pump`, which gathers the calls waiting within a short window into one
sampling call. Synchronously (``rollout.max_staleness=0``) that is the trainer's main thread and
:meth:`~microrl.rollout.RolloutBackend._sample` (the ``hf`` backend's batched
``generate``, the colocated ``vllm`` backend's), where the backend (FSDP gathers, CUDA streams,
collectives) expects it; under ``torchrun`` every rank pumps in lockstep: a round samples on
every rank when any rank has calls (a rank with none samples a stand-in row it discards), as
:mod:`microrl.rollout.episodes` does per turn. Asynchronously it is a thread submitting
jobs to the out-of-process sampler (:mod:`microrl.agents.agent_sampler`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch

from microrl.engine.moe.routes import NO_ROUTE, ROUTED_EXPERTS_KEY
from microrl.engine.parallel import distributed
from microrl.rollout.base import RolloutBackend, Samples, SamplingParams
from microrl.rollout.sampler import POLICY_VERSION_KEY
from microrl.rollout.turns import turn_terminators

__all__ = ["BatchingSampler", "Turn"]

# How long a pump round waits for the first call (an idle round costs one all-reduce under DP).
_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class Turn:
    """A sampled model turn: ids up to and including its terminator (``ended``), or cut at the
    call's token limit; their log-probs; the policy version that sampled them (None: the
    trainer's own weights, synchronously). ``routes``: with a sampler recording the routing
    (``rollout.routing_replay``), the experts of the call's prompt and of these ids ``[n, L, k]``
    from this turn's forwards (-1 for a token it sampled but never fed); None otherwise."""

    ids: list[int]
    logprobs: list[float]
    version: int | None
    ended: bool
    routes: torch.Tensor | None = None


@dataclass
class _Call:
    prompt_ids: list[int]
    max_tokens: int
    future: Future


#: ``(prompt_ids, params) -> (samples, versions)``: one batched sampling call and the policy
#: version of each row.
SampleFn = Callable[[list[list[int]], SamplingParams], tuple[Samples, list[int | None]]]


class BatchingSampler:
    """Samples the endpoint's calls in batched calls of ``sample`` (see the module docstring).

    Args:
        sample: the batched sampling call: :meth:`over_backend` (a synchronous backend's) or
            :meth:`over_async` (an :class:`~microrl.rollout.Sampler`'s jobs).
        tokenizer: the policy's.
        params: the run's sampling parameters (temperature, greedy, top-k/top-p); each call sets
            its own token limit.
        window_s: how long a round keeps gathering calls after the first, unless every running
            episode is already waiting.
        collective: under ``torchrun``, pump in lockstep with the other ranks (a backend whose
            sampling is collective, e.g. FSDP-sharded ``generate``).
        stop_ids: the token ids that end a turn (default: the tokenizer's turn terminators, its
            chat template's turn end and ``eos_token_id``,
            :func:`~microrl.rollout.turns.turn_terminators`); a backend's own
            ``stop_token_ids`` (with ``generation_config``'s) where it has them.
    """

    def __init__(
        self,
        sample: SampleFn,
        tokenizer: Any,
        params: SamplingParams,
        *,
        window_s: float = 0.02,
        collective: bool = False,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        self.sample = sample
        self.tokenizer = tokenizer
        self.params = params
        self.window_s = window_s
        self.collective = collective
        self.stop_ids = set(stop_ids or turn_terminators(tokenizer, require_template=False))
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._rounds = 0

    @classmethod
    def over_backend(
        cls,
        backend: RolloutBackend,
        params: SamplingParams,
        *,
        version: int | None = None,
        **kwargs: Any,
    ) -> BatchingSampler:
        """Batches sampled by ``backend._sample`` on the pumping thread, all at ``version``
        (None: the trainer's current weights, no version recorded); in lockstep over ranks
        under ``torchrun``."""
        if not isinstance(backend, RolloutBackend):
            raise TypeError(f"backend must be a RolloutBackend, got {type(backend).__name__}")

        def sample(prompts: list[list[int]], params: SamplingParams) -> tuple[Samples, list]:
            return backend._sample(prompts, params), [version] * len(prompts)

        kwargs.setdefault("stop_ids", backend.stop_token_ids)  # the turn ends it stops at
        return cls(sample, backend.tokenizer, params, collective=True, **kwargs)

    @classmethod
    def over_async(
        cls, sampler: Any, tokenizer: Any, params: SamplingParams, lock: Any, **kwargs: Any
    ) -> BatchingSampler:
        """Batches sampled as jobs of an out-of-process ``sampler`` (``submit``, then
        ``collect``, holding ``lock``, which guards the sampler against the trainer's own calls);
        each row carries the policy version its job sampled."""

        def sample(prompts: list[list[int]], params: SamplingParams) -> tuple[Samples, list[int]]:
            with lock:
                rollout = sampler.collect(sampler.submit(prompts, params))
            batch = rollout.batch
            ids, logprobs = [], []
            for row in range(len(prompts)):
                mask = batch["loss_mask"][row].bool()
                ids.append(batch["input_ids"][row][mask].tolist())
                logprobs.append(batch["rollout_logprobs"][row][mask].tolist())
            routes = _relaid_routes(batch, prompts)
            return Samples(ids, logprobs, routes), batch[POLICY_VERSION_KEY].tolist()

        if not kwargs.get("stop_ids"):  # else the tokenizer's turn terminators (the default)
            kwargs["stop_ids"] = getattr(sampler, "stop_token_ids", None)
        return cls(sample, tokenizer, params, **kwargs)

    def submit(self, prompt_ids: list[int], max_tokens: int) -> Future:
        """Queue a call (thread-safe); its future gets the :class:`Turn`."""
        future: Future = Future()
        self._queue.put(_Call(list(prompt_ids), int(max_tokens), future))
        return future

    def pump(self, running: Callable[[], int]) -> None:
        """Sample queued calls until ``running()`` (episodes still going on this rank) is 0 on
        every rank. A backend error fails the waiting calls and is raised here."""
        while True:
            calls = self._gather(running)
            state = 2 if calls else (1 if running() > 0 else 0)
            if self.collective:
                state = distributed.max_over_ranks(state)
            if state == 0:
                return
            if state == 2:
                self._sample(calls)

    def _gather(self, running: Callable[[], int]) -> list[_Call]:
        try:
            calls = [self._queue.get(timeout=_IDLE_WAIT_S)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.window_s
        while len(calls) < running():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                calls.append(self._queue.get(timeout=remaining))
            except queue.Empty:
                break
        while True:  # whatever else is already waiting
            try:
                calls.append(self._queue.get_nowait())
            except queue.Empty:
                return calls

    def _sample(self, calls: list[_Call]) -> None:
        self._rounds += 1
        seed = None if self.params.seed is None else self.params.seed + self._rounds
        limit = max((c.max_tokens for c in calls), default=1)
        params = replace(self.params, num_samples=1, max_new_tokens=limit, seed=seed)
        prompts = [c.prompt_ids for c in calls] or [[self.tokenizer.eos_token_id]]
        try:
            samples, versions = self.sample(prompts, params)
        except BaseException as err:
            for call in calls:
                call.future.set_exception(err)
            raise
        width = max(len(p) for p in prompts)
        rows = zip(calls, samples.token_ids, samples.logprobs, versions, strict=False)
        for i, (call, ids, logprobs, version) in enumerate(rows):
            turn = self._turn(ids, logprobs, call.max_tokens, version)
            if samples.routed_experts is not None:  # the call's prompt, then its turn's ids
                start = width - len(call.prompt_ids)
                routes = samples.routed_experts[i, start : width + len(turn.ids)].clone()
                turn = replace(turn, routes=routes)
            call.future.set_result(turn)

    def _turn(self, ids: list[int], logprobs: list[float], max_tokens: int, version) -> Turn:
        end = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        end = min(end, max_tokens)
        ids = list(ids[:end])
        ended = bool(ids) and ids[-1] in self.stop_ids
        return Turn(ids, list(logprobs[:end]), version, ended)


def _relaid_routes(batch: Any, prompts: list[list[int]]) -> torch.Tensor | None:
    """A job's recorded ``routed_experts`` (rows' layout ``[B, T, L, k]``) in the layout of
    :class:`~microrl.rollout.Samples`: each row's real tokens (prompt, then response) with the
    prompts left-padded to the longest; None when the job recorded none."""
    if ROUTED_EXPERTS_KEY not in batch:
        return None
    routes, real = batch[ROUTED_EXPERTS_KEY], batch["attention_mask"].bool()
    width = max(len(p) for p in prompts)
    out = routes.new_full((len(prompts), width + routes.shape[1], *routes.shape[2:]), NO_ROUTE)
    for row, prompt in enumerate(prompts):
        tokens = routes[row][real[row]]
        start = width - len(prompt)
        out[row, start : start + len(tokens)] = tokens
    return out
