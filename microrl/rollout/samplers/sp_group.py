"""One asynchronous sampler per sequence-parallel group (docs/async.md#sequence-parallelism).

The processes of an sp group are one data rank: the group's first process owns the sampler and
broadcasts every rollout it collects to the others. A push's collectives (FSDP2 gathers, the
probe) span ``dp x sp``: the others join them without a sampler (:class:`HFPushJoiner`;
:class:`~microrl.rollout.weights.server_syncs.ServerSyncJoiner`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from microrl.engine.checkpoint.export import locate_base_model
from microrl.engine.parallel import distributed
from microrl.rollout.base import Images, Prompts, Rollout, SamplingParams, draw_seed
from microrl.rollout.sampler import Job, Sampler, WorkerError
from microrl.rollout.weights.full_weights import FullWeights
from microrl.rollout.weights.sync_check import engine_probe

__all__ = ["HFPushJoiner", "SPGroupSampler"]


class SPGroupSampler(Sampler):
    """The asynchronous sampler of a sequence-parallel group, on each of its processes.

    Build it with :meth:`start` and call every method on every process of the group in the
    same order. On the processes after the first, ``submit`` draws the job's seed as the sampler
    does (torch's generators stay in step), ``collect`` receives the first's rollout, and
    ``sync`` joins the push's collectives (``join_push``).
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
        """``make_sampler()`` (holding ``engine``'s weights as ``version``) on the first process of
        ``engine.sp_group``; on the others ``make_joiner()``, which joins the sampler's start and
        returns what joins each push. Collective."""
        group = engine.sp_group
        if dist.get_rank(group) == 0:
            return cls(make_sampler(), group, version=version, engine=engine, env_maker=env_maker)
        join = make_joiner()
        return cls(None, group, version=version, join_push=join, engine=engine, env_maker=env_maker)

    @property
    def version(self) -> int:
        return self.sampler.version if self.is_leader else self._version

    @property
    def sync_stats(self) -> dict[int, dict[str, float]]:
        """The sampler's on the first process; on the others, those sent with the last rollout."""
        return self.sampler.sync_stats if self.is_leader else self._sync_stats

    def sync(self, engine: Any = None) -> None:
        """Collective over every process of the group."""
        engine = engine if engine is not None else self.engine
        if self.is_leader:
            self.sampler.sync(engine)
        else:
            self.join_push(engine)
            self._version += 1

    def poll(self) -> None:
        if self.is_leader:  # a failed check stops it, and the launcher the group
            self.sampler.poll()

    def submit(self, prompts: Prompts, params: SamplingParams, *, images: Images = None) -> Job:
        if self.is_leader:
            if images is None:  # a text job: any sampler takes it
                return self.sampler.submit(prompts, params)
            return self.sampler.submit(prompts, params, images=images)
        return self._mirror("generate", params)

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        if self.is_leader:
            return self.sampler.submit_episodes(problems, params, **limits, seed=seed)
        return self._mirror("episodes", params)

    def _mirror(self, kind: str, params: SamplingParams) -> Job:
        draw_seed(params)  # the seed the first process's sampler drew from the same generator
        return Job(next(self._jobs), self._version, kind)

    def collect(self, job: Job) -> Rollout:
        """Collected by the first process and broadcast to the others with the checks of the
        pushes so far. Collective over the group."""
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
        if self.is_leader:
            self.sampler.close()


class HFPushJoiner:
    """Joins each ``hf`` worker's push on a process without a sampler; building it joins the
    start of ``num_workers`` workers (each pushes everything, then checks it)."""

    def __init__(self, engine: Any, tokenizer: Any, *, num_workers: int) -> None:
        self.prefix = locate_base_model(engine.module)[0]
        self.probe = engine_probe(engine, tokenizer)  # the workers' probe
        for _ in range(num_workers):
            self(engine, first=True)

    def __call__(self, engine: Any, *, first: bool = False) -> None:
        """Join an ``hf`` worker's push: gather every tensor (``first``: a worker's start) or the
        trainable ones, dropped, then score the probe. It mirrors ``AsyncRollout.wait_started``
        and ``GlooBroadcast.push`` in order (tests/examples/test_examples_sequence_parallel.py)."""
        for _ in FullWeights(engine.module, self.prefix, trainable_only=not first):
            pass
        engine.infer_batch(self.probe)
