"""The one interface the trainer drives every sampler through, in process or out of it: jobs
now, rollouts later, each at the policy version known when submitted (docs/async.md)."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from microrl.engine.base import Engine
from microrl.rollout.base import (
    Images,
    Prompts,
    Rollout,
    SamplingParams,
    check_params,
    check_tokenizer,
    draw_seed,
    encode_prompts,
)
from microrl.rollout.images import ImageEncoder, check_image_prompts
from microrl.rollout.weights.sync_check import default_sync_check_tol, engine_probe

__all__ = [
    "POLICY_VERSION_KEY",
    "Job",
    "Sampler",
    "SamplerOptions",
    "WorkerError",
    "WorkerSampler",
]

#: The per-row ``[B]`` int64 batch key holding the policy version a row was sampled with.
POLICY_VERSION_KEY = "policy_version"


class WorkerError(RuntimeError):
    """A sampler process failed, died, or did not answer in time."""


@dataclass(frozen=True)
class Job:
    """A submitted job: its id and the policy version it samples."""

    id: int
    version: int
    kind: str


@dataclass(frozen=True)
class SamplerOptions:
    """What every out-of-process sampler starts with; the recipes fill it from ``rollout.*``.

    Attributes:
        version: the policy version of the engine's current weights (the recipe: its step).
        env_maker: for multi-turn tasks, ``problem -> environment``; must pickle (``hf`` workers).
        timeout_s: the longest wait for a worker or server before :class:`WorkerError`, > 0.
        sync_check_tol: the largest :data:`~microrl.rollout.weights.sync_check.SYNC_CHECK_STAT`
            a push may show, > 0; None: by the engine's precision.
        num_threads: each ``hf`` worker's torch threads or local vLLM server's CPU threads.
        image_encoder: a vision-language policy's: jobs may then carry images.
        record_routing: rows carry each token's MoE ``routed_experts`` (``hf`` workers only).

    A bad value is a ``ValueError`` naming the field.
    """

    version: int = 0
    env_maker: Callable[[Any], Any] | None = None
    timeout_s: float = 600.0
    sync_check_tol: float | None = None
    num_threads: int = 1
    image_encoder: ImageEncoder | None = None
    record_routing: bool = False

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.sync_check_tol is not None and not self.sync_check_tol > 0:
            raise ValueError(f"sync_check_tol must be > 0 or None, got {self.sync_check_tol!r}")


class Sampler(ABC):
    """Samples for the trainer: submit jobs now, collect their rollouts later.

    ``version``: the policy version the next job samples; ``sync_stats[version]``: each verified
    push's probe statistics; ``trainer_thread``: ``collect`` must run on the trainer's thread,
    every rank in step; ``samples_at_collect``: a job samples only when collected. A subclass
    implements the abstract methods and, for multi-turn tasks, :meth:`_submit_episodes`.
    """

    version: int
    sync_stats: dict[int, dict[str, float]]
    #: ``problem -> environment``; needed unless the sampler plays episodes its own way (agents).
    env_maker: Callable[[Any], Any] | None = None
    needs_env_maker: bool = True
    trainer_thread: bool = False  # out-of-process samplers: neither
    samples_at_collect: bool = False

    @abstractmethod
    def submit(self, prompts: Prompts, params: SamplingParams, *, images: Images = None) -> Job:
        """Queue sampling ``params.num_samples`` responses per prompt; ``images``: each text
        prompt's PIL images (as ``RolloutBackend.generate`` takes them)."""

    def submit_episodes(
        self,
        problems: Sequence[Any],
        params: SamplingParams,
        *,
        max_turns: int,
        max_tokens: int,
        skip_env_errors: bool = False,
        seed: int | None = None,
    ) -> Job:
        """Queue the multi-turn episodes of ``problems`` (each row's environment
        ``env_maker(problem)``); ``seed``: the job's seed (None: drawn from ``params``)."""
        if self.env_maker is None and self.needs_env_maker:
            raise ValueError(f"submit_episodes needs the env_maker given to {type(self).__name__}")
        check_params(params)
        problems = list(problems)
        if not problems:
            raise ValueError("problems must be a non-empty list")
        limits = dict(max_turns=max_turns, max_tokens=max_tokens, skip_env_errors=skip_env_errors)
        return self._submit_episodes(problems, params, limits, seed)

    def _submit_episodes(
        self, problems: list, params: SamplingParams, limits: dict[str, Any], seed: int | None
    ) -> Job:
        raise NotImplementedError(f"{type(self).__name__} plays no multi-turn episodes")

    @abstractmethod
    def collect(self, job: Job) -> Rollout:
        """The rollout of ``job``, waiting for it; its batch carries ``policy_version``."""

    @abstractmethod
    def poll(self) -> None:
        """Raise what has failed so far (a push's check, a worker) without waiting."""

    @abstractmethod
    def sync(self, engine: Any = None) -> None:
        """Push the engine's weights as version ``version + 1``; jobs from now on sample them."""

    @abstractmethod
    def close(self) -> None:
        """Stop the sampler (its processes, its backend); idempotent."""

    def generate(
        self, prompts: Prompts, params: SamplingParams, *, images: Images = None
    ) -> Rollout:
        """Sample now, at the latest pushed version (:meth:`submit`, then :meth:`collect`)."""
        return self.collect(self.submit(prompts, params, images=images))

    def _take_options(self, engine: Any, options: SamplerOptions | None) -> SamplerOptions:
        """Keep ``options`` (None: the defaults) and the state read from them
        (``sync_check_tol`` None: ``engine``'s default)."""
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be a microrl engine, got {type(engine).__name__}")
        options = SamplerOptions() if options is None else options
        if not isinstance(options, SamplerOptions):
            raise TypeError(f"options must be a SamplerOptions, got {type(options).__name__}")
        self.options = options
        self.version = int(options.version)
        self.env_maker = options.env_maker
        self.timeout_s = float(options.timeout_s)
        self.sync_check_tol = options.sync_check_tol or default_sync_check_tol(engine)
        self.image_encoder = options.image_encoder
        return options

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerSampler(Sampler):
    """The bookkeeping every sampler in other processes shares (job ids and seeds, closing
    once); a subclass implements :meth:`_push` and :meth:`_close`."""

    #: How errors name the sampler.
    name = "the sampler"
    _closed = False

    def _start(
        self, engine: Any, tokenizer: Any, options: SamplerOptions | None, *, checks: bool = True
    ) -> SamplerOptions:
        """:meth:`_take_options`, keeping ``engine`` and ``tokenizer``; ``checks``: own pushes."""
        self.tokenizer = check_tokenizer(tokenizer)
        options = self._take_options(engine, options)
        self.engine = engine
        self._jobs = itertools.count()
        #: The seconds of each job, in the order they ran.
        self.job_seconds: list[float] = []
        if checks:
            self.probe = engine_probe(engine, tokenizer)
            self.sync_stats: dict[int, dict[str, float]] = {}
            self.sync_seconds: list[float] = []
        return options

    def _job_prompts(self, prompts: Prompts, images: Images) -> tuple[list, list | None]:
        """Text prompts' token ids, or (with ``images``, checked) the texts and their images."""
        if images is None:
            return encode_prompts(self.tokenizer, prompts), None
        check_image_prompts(self, prompts, images)
        return list(prompts), [list(row) for row in images]

    def _new_job(self, kind: str, params: SamplingParams, seed: int | None = None):
        """The next job, at ``version``, and its seed (None: :func:`draw_seed` here, from
        torch's generator, so a resumed run samples what it would have)."""
        self._check_open()
        check_params(params)
        job = Job(next(self._jobs), self.version, kind)
        return job, draw_seed(params) if seed is None else seed

    def sync(self, engine: Any = None) -> None:
        self._check_open()
        version = self.version + 1
        self._push(engine or self.engine, version)
        self.version = version

    @abstractmethod
    def _push(self, engine: Any, version: int) -> None:
        """Push ``engine``'s weights as ``version`` (the check answers later: :meth:`poll`)."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._close()

    @abstractmethod
    def _close(self) -> None: ...

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerError(f"{self.name} is closed")
