"""Several asynchronous ``hf`` generation workers behind one trainer (``rollout.num_workers``).

A job's prompts are cut into contiguous chunks of whole prompts, one job per worker, sampled at
once and merged back in order; each part's seed derives from the job's (:func:`part_seeds`), so
a resumed run samples what it would have. ``sync`` gathers the weights once for every worker.
docs/async.md#several-workers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

import torch

from microrl.engine.parallel import distributed
from microrl.rollout.base import SEED_RANGE, Images, Prompts, Rollout, SamplingParams
from microrl.rollout.episodes import EpisodeError
from microrl.rollout.merge import merge_rollouts
from microrl.rollout.sampler import Job, SamplerOptions, WorkerError, WorkerSampler
from microrl.rollout.samplers.hf_worker import AsyncRollout, warn_if_oversubscribed
from microrl.rollout.weights.gloo import GlooBroadcast
from microrl.rollout.weights.sync_check import SyncCheckError

__all__ = ["AsyncRolloutPool", "Part", "PoolJob", "check_num_workers", "part_seeds", "split_sizes"]


def _all_episodes_failed(err: Exception) -> bool:
    """Whether every episode of a part failed under ``skip_env_errors`` (``_Player.finish``'s
    error): the part is dropped like its rows, unless every part's are."""
    return isinstance(err, EpisodeError) and str(err).startswith("every one of the ")


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
    """The seeds of a job's ``parts`` parts: ``seed`` itself, then draws of a generator seeded
    with it (reproducible, distinct with overwhelming probability)."""
    if parts <= 1:
        return [seed][:parts]
    generator = torch.Generator().manual_seed(seed)
    return [seed, *torch.randint(SEED_RANGE, (parts - 1,), generator=generator).tolist()]


@dataclass(frozen=True)
class Part:
    """A part of a pool job: the worker index, its job there, and its prompts' range."""

    worker: int
    job: Job
    start: int
    size: int


@dataclass(frozen=True)
class PoolJob(Job):
    """A job of an :class:`AsyncRolloutPool`: a :class:`Job` and its :class:`Part` per worker."""

    parts: tuple[Part, ...] = ()
    num_samples: int = 1
    skip_env_errors: bool = False


class AsyncRolloutPool(WorkerSampler):
    """``num_workers`` :class:`AsyncRollout` workers sampling the parts of each job together.

    Args:
        engine, tokenizer, options: as :class:`AsyncRollout`'s, for every worker.
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
        count = check_num_workers(num_workers)
        options = self._start(engine, tokenizer, options, checks=False)
        rank = f" of rank {distributed.rank()}" if distributed.is_distributed() else ""
        base = name or "the rollout worker"
        self.name = f"the {count} rollout workers{rank}" if name is None else f"{name} 1-{count}"
        #: Per collected job: the CPU seconds of all its parts (``job_seconds``: the slowest's).
        self.job_cpu_seconds: list[float] = []
        warn_if_oversubscribed(self.name, [options.num_threads] * count)
        #: The workers, in the order of the chunks they sample.
        self.workers: list[AsyncRollout] = []
        #: Gathered once, broadcast to each worker.
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

    @property
    def sync_stats(self) -> dict[int, dict[str, float]]:
        """The probe statistics of each push every worker has checked: the largest."""
        stats = [worker.sync_stats for worker in self.workers]
        checked = [v for v in sorted(stats[0]) if all(v in s for s in stats[1:])]
        return {v: {k: max(s[v][k] for s in stats) for k in stats[0][v]} for v in checked}

    @property
    def sync_seconds(self) -> list[float]:
        """Per push every worker has loaded: the slowest worker's seconds."""
        loaded = zip(*(w.sync_seconds for w in self.workers), strict=False)  # shortest: by all
        return [max(seconds) for seconds in loaded]

    def _close(self) -> None:
        for worker in self.workers:  # an idle worker exits as soon as it reads this
            worker.request_stop()
        for worker in self.workers:
            worker.close()

    def _push(self, engine, version: int) -> None:
        self.weight_sync.push(engine, version)

    def poll(self) -> None:
        self._check_open()
        for worker in self.workers:
            worker.poll()

    def submit(self, prompts: Prompts, params: SamplingParams, *, images: Images = None) -> PoolJob:
        prompts, images = self._job_prompts(prompts, images)

        def submit(worker: AsyncRollout, part: slice, part_params: SamplingParams, seed: int):
            rows = None if images is None else images[part]
            return worker.submit(prompts[part], part_params, images=rows, seed=seed)

        return self._split(len(prompts), params, submit)

    def _submit_episodes(self, problems, params, limits, seed) -> PoolJob:
        """With ``skip_env_errors`` a part whose every episode failed is dropped like its rows
        (``episodes/env_errors`` counts them). ``seed``: unused, a pool draws part seeds."""

        def submit(worker: AsyncRollout, part: slice, part_params: SamplingParams, seed: int):
            return worker.submit_episodes(problems[part], part_params, **limits, seed=seed)

        return self._split(len(problems), params, submit, "episodes", limits["skip_env_errors"])

    def _split(
        self, items: int, params: SamplingParams, submit, kind="generate", skip_env_errors=False
    ) -> PoolJob:
        """``submit(worker, part, params, seed)`` for each worker's slice ``part`` of the items."""
        job, seed = self._new_job(kind, params)
        seeds = part_seeds(seed, len(self.workers))
        parts, start = [], 0
        for index, size in enumerate(split_sizes(items, len(self.workers))):
            if size == 0:
                break  # the sizes do not increase: no worker after this one has prompts
            seed = seeds[index]
            part_params = params if params.seed in (None, seed) else replace(params, seed=seed)
            worker_job = submit(self.workers[index], slice(start, start + size), part_params, seed)
            parts.append(Part(index, worker_job, start, size))
            start += size
        return PoolJob(
            **vars(job),
            parts=tuple(parts),
            num_samples=params.num_samples,
            skip_env_errors=skip_env_errors,
        )

    def collect(self, job: PoolJob) -> Rollout:
        self._check_open()
        if not isinstance(job, PoolJob):
            raise TypeError(f"job must be a PoolJob of this pool, got {type(job).__name__}")
        results, dropped, error = [], [], None
        for part in job.parts:  # every part, even after an error: none is left behind
            worker = self.workers[part.worker]
            try:
                results.append((part, *worker.collect_timed(part.job)))
            except Exception as err:
                if job.skip_env_errors and _all_episodes_failed(err):
                    dropped.append(part)
                elif error is None:
                    error = _located(err, worker, part)
        if error is not None:
            raise error
        self.poll()  # the checks of workers without a part surface now too
        self.job_seconds.append(max((s[0] for _, _, s in results), default=0.0))
        self.job_cpu_seconds.append(sum(s[1] for _, _, s in results))
        failed = sum(part.size for part in dropped) * job.num_samples
        if not results:
            raise EpisodeError(
                f"every one of the {failed} episodes failed in its environment "
                "(rollout.skip_env_errors drops failed rows, but none is left)"
            )
        rollouts = [rollout for _, rollout, _ in results]
        pad = self.tokenizer.pad_token_id
        merged = rollouts[0] if len(rollouts) == 1 else merge_rollouts(rollouts, pad_token_id=pad)
        metrics = dict(merged.metrics)
        if dropped:
            metrics["episodes/env_errors"] = metrics.get("episodes/env_errors", 0.0) + failed
        # Each part's group ids index its chunk: shifted to index the job's prompts (a prompt
        # whose every row was dropped keeps its gap, as from one worker).
        group_ids = torch.cat([rollout.group_ids + part.start for part, rollout, _ in results])
        return dataclasses.replace(merged, group_ids=group_ids, metrics=metrics)

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerError(f"{self.name} are closed")


def _located(err: Exception, worker: AsyncRollout, part: Part) -> Exception:
    """``err`` of a part's job, with a note naming its worker and prompts (a worker's own
    errors name it already)."""
    if not isinstance(err, WorkerError | SyncCheckError):
        err.add_note(
            f"(from {worker.name}, sampling prompts {part.start}..{part.start + part.size - 1} "
            f"of the job: its row and prompt indices count from prompt {part.start})"
        )
    return err
