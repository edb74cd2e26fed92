"""One model turn per endpoint call, sampled by the run's backend in batches.

The endpoint's handlers (on the server's event loop) queue calls here; the trainer process's main
thread runs :meth:`BatchingSampler.pump`, which gathers the calls waiting within a short window
into one :meth:`~microrl.engine.rollout.RolloutBackend._sample` call (the ``hf`` backend's batched
``generate``, the colocated ``vllm`` backend's ``generate``). Sampling stays on the main thread,
where the backend (FSDP gathers, CUDA streams, collectives) expects it. Under ``torchrun`` every
rank pumps in lockstep: a round samples on every rank when any rank has calls (a rank with none
samples a stand-in row it discards), as :mod:`microrl.engine.rollout.episodes` does per turn.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

from microrl.engine.parallel import distributed
from microrl.engine.rollout.base import RolloutBackend, SamplingParams

__all__ = ["BatchingSampler", "Turn"]

# How long a pump round waits for the first call (an idle round costs one all-reduce under DP).
_IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class Turn:
    """A sampled model turn: ids up to and including its terminator (``ended``), or cut at the
    call's token limit; their log-probs; the policy version that sampled them."""

    ids: list[int]
    logprobs: list[float]
    version: int
    ended: bool


@dataclass
class _Call:
    prompt_ids: list[int]
    max_tokens: int
    future: Future


class BatchingSampler:
    """Samples the endpoint's calls with ``backend`` in batched calls (see the module docstring).

    Args:
        backend: the run's synchronous backend (``hf``, ``vllm``).
        params: the run's sampling parameters (temperature, greedy, top-k/top-p); each call sets
            its own token limit.
        version: the policy version the backend holds (the turns carry it).
        window_s: how long a round keeps gathering calls after the first, unless every running
            episode is already waiting.
        stop_ids: the token ids that end a turn (default: the tokenizer's ``eos_token_id``).
    """

    def __init__(
        self,
        backend: RolloutBackend,
        params: SamplingParams,
        *,
        version: int = 0,
        window_s: float = 0.02,
        stop_ids: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(backend, RolloutBackend):
            raise TypeError(f"backend must be a RolloutBackend, got {type(backend).__name__}")
        self.backend = backend
        self.params = params
        self.version = version
        self.window_s = window_s
        self.stop_ids = set(stop_ids or [backend.tokenizer.eos_token_id])
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._rounds = 0
        #: The largest number of calls sampled in one batch (a bound the tests check).
        self.max_batch = 0

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
        prompts = [c.prompt_ids for c in calls] or [[self.backend.tokenizer.eos_token_id]]
        self.max_batch = max(self.max_batch, len(calls))
        try:
            samples = self.backend._sample(prompts, params)
        except BaseException as err:
            for call in calls:
                call.future.set_exception(err)
            raise
        for call, ids, logprobs in zip(calls, samples.token_ids, samples.logprobs, strict=False):
            call.future.set_result(self._turn(ids, logprobs, call.max_tokens))

    def _turn(self, ids: list[int], logprobs: list[float], max_tokens: int) -> Turn:
        end = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), len(ids))
        end = min(end, max_tokens)
        ids = list(ids[:end])
        ended = bool(ids) and ids[-1] in self.stop_ids
        return Turn(ids, list(logprobs[:end]), self.version, ended)
