"""Several asynchronous ``hf`` generation workers behind one trainer (``rollout.num_workers``).

A job's prompts are cut into ``num_workers`` contiguous chunks of whole prompts (a group never
straddles two workers; :func:`split_sizes`), each a job of its worker, sampled at the same time
and merged back in the job's order (``merge_rollouts``). One seed is drawn per job as
``AsyncRollout`` draws it and each part's derives from it (:func:`part_seeds`), so a resumed run
samples what it would have. ``sync`` gathers the weights once and pushes them to every worker
(:class:`~microrl.rollout.weights.gloo.GlooBroadcast`); each checks its push, and
``sync_stats`` holds the largest statistics once every worker has. The workers are spawned
together and given their first weights one after the other; a failed start closes them all.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from microrl.engine.parallel import distributed
from microrl.rollout.base import (
    SEED_RANGE,
    Rollout,
    SamplingParams,
    check_tokenizer,
    draw_seed,
    encode_prompts,
)
from microrl.rollout.episodes import EpisodeError
from microrl.rollout.images import check_image_prompts
from microrl.rollout.merge import merge_rollouts
from microrl.rollout.sampler import Job, Sampler, SamplerOptions, WorkerError
from microrl.rollout.samplers.hf_worker import AsyncRollout, warn_if_oversubscribed
from microrl.rollout.weights.gloo import GlooBroadcast
from microrl.rollout.weights.sync_check import SyncCheckError

__all__ = [
    "AsyncRolloutPool",
    "Part",
    "PoolJob",
    "check_num_workers",
    "part_seeds",
    "split_sizes",
]

# The start of the message of the EpisodeError a worker raises when every episode of its part
# failed under skip_env_errors (microrl.rollout.episodes._Player.finish): in a pool that
# part is only dropped, as its rows would be from one worker, unless every part's are.
_ALL_EPISODES_FAILED = "every one of the "


def check_num_workers(num_workers: Any) -> int:
    """``num_workers``, or a ``ValueError`` naming it when it is not an int >= 1."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
        raise ValueError(
            f"num_workers (rollout.num_workers) must be an int >= 1, got {num_workers!r}"
        )
    return num_workers


def split_sizes(items: int, parts: int) -> list[int]:
    """The sizes of ``parts`` contiguous chunks of ``items`` whole items, as even as possible
    (the first ``items % parts`` one longer; 0 for parts beyond the items)."""
    base, extra = divmod(items, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def part_seeds(seed: int, parts: int) -> list[int]:
    """The seeds of a job's ``parts`` parts from the job's ``seed``: ``seed`` itself for the
    first, then draws of a generator seeded with it (reproducible, distinct with overwhelming
    probability)."""
    if parts <= 1:
        return [seed][:parts]
    generator = torch.Generator().manual_seed(seed)
    return [seed, *torch.randint(SEED_RANGE, (parts - 1,), generator=generator).tolist()]


@dataclass(frozen=True)
class Part:
    """A part of a pool job: the worker (index) sampling it, its job there, and the range of
    the pool job's prompts it holds (``start``, ``size``)."""

    worker: int
    job: Job
    start: int
    size: int


@dataclass(frozen=True)
class PoolJob(Job):
    """A job of an :class:`AsyncRolloutPool`: ``id``, ``version`` and ``kind`` as a
    :class:`Job`'s, and its :class:`Part` on each worker that samples some of it."""

    parts: tuple[Part, ...] = ()
    num_samples: int = 1
    skip_env_errors: bool = False


class AsyncRolloutPool(Sampler):
    """``num_workers`` :class:`AsyncRollout` workers sampling the parts of each job together
    (see the module docstring).

    Args:
        engine, tokenizer, options: as :class:`AsyncRollout`'s, for every worker
            (``options.num_threads`` each).
        num_workers: the worker processes (``rollout.num_workers``), >= 1.
        name: how errors name the workers (each ``"<name> <i> of <num_workers>"``).

    Under ``torchrun`` each rank owns a pool; :meth:`sync` is collective (once per pool).
    """

    def __init__(
        self,
        engine,
        tokenizer,
        options: SamplerOptions | None = None,
        *,
        num_workers: int,
        name: str | None = None,
    ) -> None:
        self.tokenizer = check_tokenizer(tokenizer)
        count = check_num_workers(num_workers)
        options = self._take_options(engine, options)
        self.engine = engine
        rank = f" of rank {distributed.rank()}" if distributed.is_distributed() else ""
        base = name or "the rollout worker"
        #: How errors name the pool.
        self.name = f"the {count} rollout workers{rank}" if name is None else f"{name} 1-{count}"
        self._jobs = itertools.count()
        self._closed = False
        #: Per collected job (in collect order): the wall seconds of its slowest part (the
        #: parts run at once) and the CPU seconds of all its parts.
        self.job_seconds: list[float] = []
        self.job_cpu_seconds: list[float] = []
        warn_if_oversubscribed(self.name, [options.num_threads] * count)
        #: The workers, in the order of the chunks they sample.
        self.workers: list[AsyncRollout] = []
        #: How each sync reaches the workers: gathered once, broadcast to each.
        self.weight_sync = GlooBroadcast(self.workers)
        try:
            for index in range(count):  # spawned together: each builds its model meanwhile
                self.workers.append(
                    AsyncRollout(
                        engine,
                        tokenizer,
                        options,
                        name=f"{base} {index + 1} of {count}{rank if name is None else ''}",
                        wait=False,
                        check_threads=False,
                    )
                )
            for worker in self.workers:
                worker.wait_started()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- state
    @property
    def processes(self) -> list:
        """The workers' processes."""
        return [worker.process for worker in self.workers]

    @property
    def sync_stats(self) -> dict[int, dict[str, float]]:
        """The probe statistics of each push every worker has checked (``sync/probe_kl``,
        ``sync/probe_abs_diff_max``, ``sync/probe_abs_diff_mean``), by version: the largest
        of the workers'."""
        stats = [worker.sync_stats for worker in self.workers]
        checked = [v for v in sorted(stats[0]) if all(v in s for s in stats[1:])]
        return {v: {k: max(s[v][k] for s in stats) for k in stats[0][v]} for v in checked}

    @property
    def sync_seconds(self) -> list[float]:
        """Per push every worker has loaded (in version order): the slowest worker's seconds
        to load it and score the probe."""
        loaded = zip(*(w.sync_seconds for w in self.workers), strict=False)  # shortest: by all
        return [max(seconds) for seconds in loaded]

    # ----------------------------------------------------------------- start and stop
    def close(self) -> None:
        """Stop every worker (all asked at once, then each closed); idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:  # an idle worker exits as soon as it reads this
            worker.request_stop()
        for worker in self.workers:
            worker.close()

    # ----------------------------------------------------------------- weights
    def sync(self, engine=None) -> None:
        """Push the engine's current weights to every worker as the next version
        (``version + 1``): gathered once, checked by each worker (see :meth:`AsyncRollout.sync`).
        Returns at once. Collective under ``torchrun``."""
        self._check_open()
        version = self.version + 1
        self.weight_sync.push(engine or self.engine, version)
        self.version = version

    def poll(self) -> None:
        """Handle what every worker has sent so far (checks of finished syncs; errors)."""
        self._check_open()
        for worker in self.workers:
            worker.poll()

    # ----------------------------------------------------------------- jobs
    def submit(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> PoolJob:
        """Queue sampling ``params.num_samples`` responses per prompt, the prompts split over
        the workers; returns the :class:`PoolJob`, whose rollout :meth:`collect` returns.
        ``images``: each text prompt's PIL images, split with their prompts."""
        self._check_open()
        _check_params(params)
        if images is not None:
            check_image_prompts(self, prompts, images)

            def submit(worker: AsyncRollout, chunk: list, part_params: SamplingParams, seed: int):
                texts, rows = [p for p, _ in chunk], [row for _, row in chunk]
                return worker.submit(texts, part_params, images=rows, seed=seed)

            return self._split(list(zip(prompts, images, strict=True)), params, submit)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        return self._split(
            prompt_ids, params, lambda worker, chunk, p, seed: worker.submit(chunk, p, seed=seed)
        )

    def _submit_episodes(self, problems, params, limits, seed) -> PoolJob:
        """Split over the workers (as :meth:`AsyncRollout.submit_episodes`); with
        ``skip_env_errors`` a part whose every episode failed is dropped like its rows
        (``episodes/env_errors`` counts them). ``seed``: unused, a pool draws part seeds."""
        self._check_open()

        def submit(worker: AsyncRollout, chunk: list, part_params: SamplingParams, seed: int):
            return worker.submit_episodes(chunk, part_params, **limits, seed=seed)

        return self._split(problems, params, submit, "episodes", limits["skip_env_errors"])

    def _split(
        self, items: list, params: SamplingParams, submit, kind="generate", skip_env_errors=False
    ) -> PoolJob:
        """``submit(worker, chunk, params, seed)`` for each worker's contiguous chunk."""
        seeds = part_seeds(draw_seed(params), len(self.workers))
        parts, start = [], 0
        for index, size in enumerate(split_sizes(len(items), len(self.workers))):
            if size == 0:
                break  # the sizes do not increase: no worker after this one has prompts
            part_params = params if params.seed is None else _with_seed(params, seeds[index])
            chunk = items[start : start + size]
            job = submit(self.workers[index], chunk, part_params, seeds[index])
            parts.append(Part(index, job, start, size))
            start += size
        return PoolJob(
            next(self._jobs),
            self.version,
            kind,
            parts=tuple(parts),
            num_samples=params.num_samples,
            skip_env_errors=skip_env_errors,
        )

    def collect(self, job: PoolJob) -> Rollout:
        """The rollout of ``job`` (waiting for each of its parts), its rows in the order of
        the job's prompts; its batch carries ``policy_version``."""
        self._check_open()
        if not isinstance(job, PoolJob):
            raise TypeError(f"job must be a PoolJob of this pool, got {type(job).__name__}")
        results, dropped, error = [], [], None
        for part in job.parts:  # every part, even after an error: none is left behind
            worker = self.workers[part.worker]
            try:
                results.append((part, *worker.collect_timed(part.job)))
            except EpisodeError as err:
                if job.skip_env_errors and str(err).startswith(_ALL_EPISODES_FAILED):
                    dropped.append(part)
                elif error is None:
                    error = _located(err, worker, part)
            except Exception as err:
                if error is None:
                    error = _located(err, worker, part)
        if error is not None:
            raise error
        for worker in self.workers:  # the checks of workers without a part surface now too
            worker.poll()
        self.job_seconds.append(max((s[0] for _, _, s in results), default=0.0))
        self.job_cpu_seconds.append(sum(s[1] for _, _, s in results))
        if not results:
            rows = sum(part.size for part in dropped) * job.num_samples
            raise EpisodeError(
                f"every one of the {rows} episodes failed in its environment "
                "(rollout.skip_env_errors drops failed rows, but none is left)"
            )
        rollouts = [rollout for _, rollout, _ in results]
        merged = (
            rollouts[0]
            if len(rollouts) == 1
            else merge_rollouts(rollouts, pad_token_id=self.tokenizer.pad_token_id)
        )
        metrics = dict(merged.metrics)
        if dropped:
            errors = sum(part.size for part in dropped) * job.num_samples
            metrics["episodes/env_errors"] = metrics.get("episodes/env_errors", 0.0) + errors
        # Each part's group ids index its chunk: shifted to index the job's prompts (a prompt
        # whose every row was dropped keeps its gap, as from one worker).
        group_ids = torch.cat([rollout.group_ids + part.start for part, rollout, _ in results])
        return dataclasses.replace(merged, group_ids=group_ids, metrics=metrics)

    # ----------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise WorkerError(f"{self.name} are closed")


def _check_params(params: Any) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return params if params.seed == seed else dataclasses.replace(params, seed=seed)


def _located(err: Exception, worker: AsyncRollout, part: Part) -> Exception:
    """``err`` of a part's job, with a note saying which worker and prompts it came from
    (its row and prompt indices count within the part). A worker's own errors (a failed
    check, a dead or hung worker) name it already."""
    if not isinstance(err, WorkerError | SyncCheckError):
        err.add_note(
            f"(from {worker.name}, sampling prompts {part.start}..{part.start + part.size - 1} "
            f"of the job: its row and prompt indices count from prompt {part.start})"
        )
    return err
