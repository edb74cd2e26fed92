"""One asynchronous sampler per sequence-parallel group (docs/async.md#sequence-parallelism).

The processes of an sp group are one data rank: they train on the same rollout. The group's
first process owns the sampler (its ``hf`` worker processes, or its vLLM servers); every
rollout it collects is broadcast to the others over the engine's sp group, so the group trains
on one sample, not on copies that would have to agree bit for bit. A push gathers FSDP2 shards
from every process and scores the probe with the engine (collectives over ``dp x sp``): the
other processes take part in those collectives without a sampler of their own (:class:`HFPushJoiner`;
:class:`~microrl.rollout.weights.server_syncs.ServerSyncJoiner` for vLLM servers).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from microrl.engine.checkpoint.export import locate_base_model
from microrl.engine.parallel import distributed
from microrl.rollout.base import Rollout, SamplingParams, draw_seed
from microrl.rollout.sampler import Job, Sampler, WorkerError
from microrl.rollout.weights.full_weights import FullWeights
from microrl.rollout.weights.sync_check import engine_probe

__all__ = ["HFPushJoiner", "SPGroupSampler", "join_hf_push"]


class SPGroupSampler(Sampler):
    """The asynchronous sampler of a sequence-parallel group, on each of its processes.

    Build it with :meth:`start` on every process of the group. On the group's first process it
    drives ``sampler`` (``submit``, ``collect``, ``sync``, ``poll``, ``close``); on the others
    ``submit`` draws the job's seed as the sampler does (torch's generator stays in step across
    the group), ``collect`` receives the first process's rollout, and ``sync`` joins the push's
    collectives (``join_push``). Every method is called on every process in the same order, as
    the recipes' rollout source does. Every sampler draws one seed per job (``draw_seed``); a
    sampler that drew otherwise would leave the group's generators apart, which the engine's
    same-batch check of the sp group reports.
    """

    trainer_thread = True  # collect broadcasts over the group: every process in step

    def __init__(
        self,
        sampler: Any | None,
        group: dist.ProcessGroup,
        *,
        version: int,
        join_push: Callable[[Any], None] | None = None,
        engine: Any = None,
        env_maker: Callable[[Any], Any] | None = None,
    ) -> None:
        self.sampler, self.group, self.join_push = sampler, group, join_push
        self.env_maker = env_maker  # the first process's sampler builds the environments
        self.engine = engine  # what sync() pushes when given none
        self.leader = dist.get_global_rank(group, 0)
        self.is_leader = dist.get_rank(group) == 0
        if self.is_leader != (sampler is not None) or self.is_leader == (join_push is not None):
            raise ValueError(
                "the sp group's first process holds the sampler, every other one a join_push"
            )
        self._version = int(version)
        self._sync_stats: dict[int, dict[str, float]] = {}
        self._jobs = itertools.count()

    @classmethod
    def start(
        cls,
        engine: Any,
        make_sampler: Callable[[], Any],
        make_joiner: Callable[[], Callable[[Any], None]],
        *,
        version: int,
        env_maker: Callable[[Any], Any] | None = None,
    ) -> SPGroupSampler:
        """``make_sampler()`` (a sampler holding ``engine``'s weights as ``version``) on the
        first process of ``engine.sp_group``; on the others ``make_joiner()``, which joins the
        collectives of the sampler's start and returns what joins each push. Collective over
        every process."""
        group = engine.sp_group
        if dist.get_rank(group) == 0:
            return cls(make_sampler(), group, version=version, engine=engine, env_maker=env_maker)
        join = make_joiner()
        return cls(None, group, version=version, join_push=join, engine=engine, env_maker=env_maker)

    # ----------------------------------------------------------------- state
    @property
    def version(self) -> int:
        """The policy version jobs submitted now sample (the group's first process's)."""
        return self.sampler.version if self.is_leader else self._version

    @property
    def sync_stats(self) -> dict[int, dict[str, float]]:
        """The checks of the pushes, by version: the sampler's on the group's first process,
        those it sent with the last rollout on the others."""
        return self.sampler.sync_stats if self.is_leader else self._sync_stats

    # ----------------------------------------------------------------- weights
    def sync(self, engine: Any = None) -> None:
        """Push ``engine``'s weights (None: the one the group started with) as the next
        version. Collective over every process."""
        engine = engine if engine is not None else self.engine
        if self.is_leader:
            self.sampler.sync(engine)
        else:
            self.join_push(engine)
            self._version += 1

    def poll(self) -> None:
        """The sampler's :meth:`poll` on the group's first process (a failed check stops it,
        and the launcher the group)."""
        if self.is_leader:
            self.sampler.poll()

    # ----------------------------------------------------------------- jobs
    def submit(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> Job:
        """Queue sampling ``params.num_samples`` responses per prompt (the same prompts, and
        ``images``, on every process of the group)."""
        if self.is_leader:
            if images is None:  # a text job: any sampler takes it
                return self.sampler.submit(prompts, params)
            return self.sampler.submit(prompts, params, images=images)
        return self._mirror("generate", params)

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        """The episodes, played by the first process's sampler."""
        if self.is_leader:
            return self.sampler.submit_episodes(problems, params, **limits, seed=seed)
        return self._mirror("episodes", params)

    def _mirror(self, kind: str, params: SamplingParams) -> Job:
        draw_seed(params)  # the seed the first process's sampler drew from the same generator
        return Job(next(self._jobs), self._version, kind)

    def collect(self, job: Job) -> Rollout:
        """The rollout of ``job``: collected by the group's first process and broadcast to the
        others (with the checks of the pushes so far). Collective over the group."""
        if self.is_leader:
            try:
                message = ("rollout", self.sampler.collect(job), dict(self.sampler.sync_stats))
            except Exception as err:
                self._broadcast(("error", f"{type(err).__name__}: {err}", None))
                raise
            return self._broadcast(message)[1]
        kind, payload, stats = self._broadcast(None)
        if kind == "error":
            raise WorkerError(
                f"the sampler of this sequence-parallel group (on process {self.leader}) "
                f"failed: {payload}"
            )
        self._sync_stats = stats
        return payload

    def _broadcast(self, message: Any) -> Any:
        box = [message]
        device = distributed.collective_device("cpu", self.group)
        dist.broadcast_object_list(box, src=self.leader, group=self.group, device=device)
        return box[0]

    def close(self) -> None:
        """Stop the sampler (on the group's first process); idempotent."""
        if self.is_leader:
            self.sampler.close()


class HFPushJoiner:
    """:func:`join_hf_push` with the probe built once; building it joins the start of
    ``num_workers`` ``hf`` workers (each pushes everything, then checks it)."""

    def __init__(self, engine: Any, tokenizer: Any, *, num_workers: int) -> None:
        self.prefix = locate_base_model(engine.module)[0]
        self.probe = engine_probe(engine, tokenizer)  # the workers' probe
        for _ in range(num_workers):
            self(engine, first=True)

    def __call__(self, engine: Any, *, first: bool = False) -> None:
        join_hf_push(engine, self.prefix, self.probe, first=first)


def join_hf_push(engine: Any, prefix: str, probe: Any, *, first: bool = False) -> None:
    """Take part in the collectives of an ``hf`` worker's push (``AsyncRollout`` and
    ``AsyncRolloutPool``) from a process that sends nothing: gather every tensor (``first``:
    a worker's start) or the trainable ones, one at a time and dropped, then score ``probe``
    with the engine (under sequence parallelism the group splits its tokens).

    It mirrors ``AsyncRollout.wait_started`` (``first``) and ``GlooBroadcast.push``, in their
    order: a change there must change this too (the group's collectives would not pair;
    tests/examples/test_examples_sequence_parallel.py runs both)."""
    for _ in FullWeights(engine.module, prefix, trainable_only=not first):
        pass
    engine.infer_batch(probe)
