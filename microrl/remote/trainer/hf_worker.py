"""Asynchronous ``hf`` rollouts: a generation worker process that samples while the trainer trains.

:class:`AsyncRollout` spawns one worker (:mod:`microrl.remote.worker.main`) that holds
its own copy of the policy and samples with the ``hf`` backend's code path. The trainer
*submits* jobs (prompts to sample, or multi-turn episodes to play) and *collects* their
rollouts later; in between it trains. Jobs run one after the other in submission order, and a
weight push (:meth:`AsyncRollout.sync`) is queued between them like a job, so the policy version
each job samples is known when it is submitted: the version pushed last before it. Every rollout
carries it, per row, as the batch key ``policy_version`` (int64 ``[B]``).

Versions count optimizer-step rounds: ``version`` at construction (the recipe's start step), one
more per :meth:`~AsyncRollout.sync`. The first push sends every tensor of the model (the worker
builds the architecture from its config, randomly initialised); later pushes send what the
optimizer changes (the LoRA adapters of a LoRA engine, every weight of a full fine-tune),
gathered from FSDP2 shards as the ``vllm`` backend gathers them, one flat buffer per dtype
broadcast over a private gloo group (never torch's default group).

**Every push is verified.** The worker scores a fixed probe batch (:func:`build_probe`) with the
weights it received and returns the log-probs and a checksum per tensor; the trainer compares
them with its own (``engine.infer_batch`` at the same version, and the tensors it pushed).
``sync_stats[version]`` holds :func:`probe_stats` (mean and max |difference|, k3 KL); a mean
difference above ``sync_check_tol`` (:data:`SYNC_CHECK_STAT`), or a tensor whose checksum differs,
raises :class:`SyncCheckError` naming the version and the tensors.

No wait is unbounded: every wait for the worker polls its liveness and gives up after
``timeout_s`` with an error naming the worker; :meth:`~AsyncRollout.close` (also at exit, and
on a trainer exception) stops it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

from microrl.engine import setup
from microrl.engine.base import Engine
from microrl.engine.checkpoint.export import locate_base_model
from microrl.engine.parallel import distributed
from microrl.engine.rollout.base import (
    Rollout,
    RolloutBackend,
    Samples,
    SamplingParams,
    draw_seed,
)
from microrl.engine.rollout.full_weights import gather_full_weights
from microrl.engine.rollout.hf import engine_autocast_dtype
from microrl.engine.rollout.layout import build_rollout
from microrl.remote.worker.main import (
    WorkerSpec,
    checksums_differ,
    dumps,
    loads,
    tensor_checksums,
    tensor_family,
    worker_main,
)

__all__ = [
    "FP32_SYNC_CHECK_TOL",
    "LOW_PRECISION_SYNC_CHECK_TOL",
    "POLICY_VERSION_KEY",
    "SYNC_CHECK_STAT",
    "AsyncRollout",
    "Job",
    "SyncCheckError",
    "WorkerError",
    "build_probe",
]

logger = logging.getLogger(__name__)

#: The per-row ``[B]`` int64 batch key holding the policy version a row was sampled with.
POLICY_VERSION_KEY = "policy_version"
#: The probe statistic ``sync_check_tol`` bounds: the mean |trainer - sampler| log-prob over the
#: probe's tokens. Not the max: bf16 rounds a logit of ~20 by up to 0.06, so the largest of the
#: ~50 differences is a few tokens' rounding, 2x apart from probe to probe (nor k3, which one
#: token far below the trainer's log-prob dominates through its exp).
SYNC_CHECK_STAT = "sync/probe_abs_diff_mean"
#: Default ``sync_check_tol`` of a float32 engine: a float32 sampler's forward differs from the
#: engine's (fused head, other batch shapes) by fp32 rounding, 10x below this; a push one
#: optimizer step stale, even by one tensor at lr 1e-6, moves the probe by more
#: (benchmarks/README.md#sync-check).
FP32_SYNC_CHECK_TOL = 5e-5
#: Default ``sync_check_tol`` of a 16-bit engine (a bf16/fp16 base or bf16 autocast): a bf16
#: sampler (the ``hf`` worker's autocast, or bf16 weights as a vLLM server holds them) differs
#: from the engine's fp32 head on bf16 activations by bf16 rounding, which grows with depth; this
#: passes it with a 2x margin and fails a push that did not land (a sampler far behind, a lost
#: tensor). A push one step stale is within the bf16 noise, which only the ``hf`` worker's
#: per-tensor checksums see (benchmarks/README.md#sync-check).
LOW_PRECISION_SYNC_CHECK_TOL = 0.25
# Rows and length of the probe batch.
_PROBE_ROWS, _PROBE_LEN = 4, 16


class WorkerError(RuntimeError):
    """The worker failed, died, or did not answer in time."""


class SyncCheckError(RuntimeError):
    """A weight push whose probe log-probs or tensor checksums differ from the trainer's."""


@dataclass(frozen=True)
class Job:
    """A submitted job: its id and the policy version it samples."""

    id: int
    version: int
    kind: str


def build_probe(vocab_size: int, max_positions: int, tokenizer, *, seed: int = 0) -> TensorDict:
    """The fixed probe batch of a sync check: a few rows of random tokens (never ``<eos>`` or
    padding) with prompts of different lengths, in the rollout layout (``input_ids``,
    ``attention_mask``, ``loss_mask`` on the "response")."""
    gen = torch.Generator().manual_seed(seed)
    specials = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    allowed = torch.tensor([t for t in range(vocab_size) if t not in specials])
    length = max(_PROBE_ROWS + 2, min(_PROBE_LEN, max_positions))
    prompts, responses = [], []
    for row in range(_PROBE_ROWS):  # prompts of 1, 2, ... tokens: left padding of every width
        draw = allowed[torch.randint(len(allowed), (length,), generator=gen)].tolist()
        prompts.append(draw[: row + 1])
        responses.append(draw[row + 1 : row + 1 + length - _PROBE_ROWS])
    samples = Samples(token_ids=responses, logprobs=[[0.0] * len(r) for r in responses])
    batch = build_rollout(
        prompts,
        samples,
        num_samples=1,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return batch.select("input_ids", "attention_mask", "loss_mask")


class AsyncRollout(RolloutBackend):
    """The ``hf`` backend in a worker process: submit jobs now, collect their rollouts later.

    Args:
        engine: the :class:`~microrl.engine.ActorEngine` whose policy is sampled; its weights
            now are pushed as ``version``.
        tokenizer: its tokenizer (picklable: it is sent to the worker).
        version: the policy version of the engine's current weights (the recipe: its step).
        env_maker: for multi-turn tasks, ``problem -> environment`` (picklable by reference:
            a task's ``make_env``); :meth:`submit_episodes` needs it.
        timeout_s: the longest wait for the worker (start, a job, a sync) before
            :class:`WorkerError`.
        sync_check_tol: the largest mean probe log-prob difference (:data:`SYNC_CHECK_STAT`) a
            sync may show; None: by the engine's precision (:data:`FP32_SYNC_CHECK_TOL`,
            :data:`LOW_PRECISION_SYNC_CHECK_TOL`).
        num_threads: the worker's torch threads (0: torch's default).
        name: how errors name the worker.
        wait: False: spawn the worker and return at once; :meth:`wait_started` completes the
            start (the first push and its check). A pool spawns its workers together this way.
        check_threads: warn when the trainer's and the worker's threads oversubscribe the
            cores (a pool checks all its workers together instead).

    Under ``torchrun`` each rank owns one (its own worker); :meth:`sync` is collective.
    """

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        version: int = 0,
        env_maker: Callable[[Any], Any] | None = None,
        timeout_s: float = 600.0,
        sync_check_tol: float | None = None,
        num_threads: int = 1,
        name: str | None = None,
        wait: bool = True,
        check_threads: bool = True,
    ) -> None:
        super().__init__(tokenizer)
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be a microrl engine, got {type(engine).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if sync_check_tol is not None and not sync_check_tol > 0:
            raise ValueError(f"sync_check_tol must be > 0 or None, got {sync_check_tol!r}")
        self.engine = engine
        self.name = name or (
            f"the rollout worker of rank {distributed.rank()}"
            if distributed.is_distributed()
            else "the rollout worker"
        )
        self.timeout_s = float(timeout_s)
        self.sync_check_tol = sync_check_tol or default_sync_check_tol(engine)
        self.version = int(version)
        #: The :func:`probe_stats` of each verified push, by version.
        self.sync_stats: dict[int, dict[str, float]] = {}
        #: The worker's seconds per job and per weight load (+ probe), in the order they ran,
        #: and its CPU seconds per job (less than the wall time: it waited for a core).
        self.job_seconds: list[float] = []
        self.job_cpu_seconds: list[float] = []
        self.sync_seconds: list[float] = []
        self._prefix, base = locate_base_model(engine.module)
        self.probe = build_probe(
            engine.vocab_size,
            getattr(base.config, "max_position_embeddings", _PROBE_LEN),
            tokenizer,
        )
        self._expected: dict[int, tuple[torch.Tensor, dict[str, tuple[float, ...]]]] = {}
        self._done: dict[int, tuple[int, Any, tuple[float, float]]] = {}
        self._jobs = itertools.count()
        self._pending_works: list[tuple[Any, list[torch.Tensor]]] = []
        self._closed = False
        self.process = None
        self._has_env_maker = env_maker is not None
        env_bytes = None
        if env_maker is not None:
            try:
                env_bytes = dumps(env_maker)
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                raise ValueError(
                    "env_maker cannot be sent to the rollout worker process (it must be "
                    f"picklable, e.g. a task's make_env): {err}"
                ) from err
        if check_threads:
            warn_if_oversubscribed(self.name, [num_threads])
        self._spawn(engine, base, tokenizer, env_bytes, num_threads)
        if wait:
            self.wait_started()

    # ----------------------------------------------------------------- start and stop
    def _spawn(self, engine, base, tokenizer, env_bytes, num_threads) -> None:
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = TCPStore(
            "127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False, timeout=timeout
        )
        device = engine.device  # the compute device (parameters may be offloaded to the host)
        spec = WorkerSpec(
            name=self.name,
            model_config=base.config,
            lora=engine.config.lora,
            tokenizer=tokenizer,
            temperature=float(engine.config.temperature),
            probe={k: v.cpu() for k, v in self.probe.items()},
            store_port=self._store.port,
            timeout_s=self.timeout_s,
            num_threads=num_threads,
            device="cpu" if device.type == "cpu" else str(device),
            env_maker=env_bytes,
            base_dtype=setup.base_dtype(engine.config),
            autocast_dtype=engine_autocast_dtype(engine),
        )
        ctx = mp.get_context("spawn")
        self._commands = ctx.Queue()
        self._results = ctx.Queue()
        self.process = ctx.Process(
            target=worker_main,
            args=(spec, self._commands, self._results),
            name="microrl-rollout-worker",
            daemon=True,  # never outlives the trainer
        )
        self.process.start()
        self._finalizer = weakref.finalize(
            self, _stop_worker, self.process, self._commands, self._results
        )

    def wait_started(self) -> None:
        """Complete the start of a worker spawned with ``wait=False``: wait for it, push the
        engine's weights (version ``version``) and check them; closes the worker on failure."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        engine = self.engine
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self._check_open()
            self._wait_for("hello", "it to start")
            self._group = ProcessGroupGloo(
                PrefixStore("microrl-rollout", self._store), 0, 2, timeout
            )
            full = self._gather(engine, trainable_only=False)
            trainable = self._gather(engine, trainable_only=True)
            self._layouts = {
                "full": [(n, tuple(t.shape), t.dtype) for n, t in full.items()],
                "trainable": [(n, tuple(t.shape), t.dtype) for n, t in trainable.items()],
            }
            self._commands.put(("layout", self._layouts))
            self._wait_for("ready", "it to check the model's tensors")
            self._push(engine, full, "full")
            del full
            self._wait_for_sync(self.version)
            # The worker holds the weights: the full push's buffers can go.
            self._pending_works = [(w, b) for w, b in self._pending_works if not w.is_completed()]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the worker (a ``close`` command, then terminate/kill if it does not exit) and
        release the group; idempotent."""
        if self._closed:
            return
        self._closed = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:  # first: a live worker still takes a push in flight
            finalizer()
        group = getattr(self, "_group", None)
        if group is not None:
            with contextlib.suppress(Exception):
                group.abort()  # a push to a worker that died must not block the exit
        self._pending_works.clear()

    def __enter__(self) -> AsyncRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- weights
    def _gather(self, engine, *, trainable_only: bool) -> dict[str, torch.Tensor]:
        return gather_weights(engine.module, self._prefix, trainable_only=trainable_only)

    def sync(self, engine=None) -> None:
        """Push the engine's current weights as the next version (``version + 1``); jobs
        submitted from now on sample them. Returns at once: the worker loads them after the jobs
        before; the check of this push runs when its answer arrives (:meth:`collect`,
        :meth:`poll`). Collective under ``torchrun`` (the weights are gathered)."""
        self._check_open()
        engine = engine or self.engine
        self._push_next(engine, self._gather(engine, trainable_only=True))

    def _push_next(self, engine, state: dict[str, torch.Tensor], expected=None) -> None:
        """Push ``state`` (the trainable tensors, gathered) as version ``version + 1``;
        ``expected``: its :meth:`_expected_of` when the caller computed it (a pool: once for
        all its workers)."""
        self._check_open()
        self.version += 1
        self._push(engine, state, "trainable", expected)

    def _expected_of(self, engine, state: dict[str, torch.Tensor]):
        """What the worker must answer to a push of ``state``: the engine's probe log-probs
        now and the tensors' checksums."""
        expected_probe = engine.infer_batch(self.probe)["logprobs"].float().cpu()
        return expected_probe, tensor_checksums(state.items())

    def _push(self, engine, state: dict[str, torch.Tensor], layout: str, expected=None) -> None:
        entries = self._layouts[layout]
        if [(n, tuple(t.shape), t.dtype) for n, t in state.items()] != entries:
            raise RuntimeError(
                f"the engine's {layout} tensors changed since {self.name} started (names, "
                "shapes or dtypes): a worker copies a fixed set"
            )
        self._expected[self.version] = expected or self._expected_of(engine, state)
        self._commands.put(("weights", self.version, layout))
        self._broadcast(state, entries)

    def _broadcast(self, state: dict[str, torch.Tensor], entries) -> None:
        """One flat buffer per dtype, broadcast asynchronously (the worker receives it when it
        reaches the ``weights`` command): the trainer does not wait for the worker here."""
        self._pending_works = [(w, b) for w, b in self._pending_works if not w.is_completed()]
        dtypes: list[torch.dtype] = []
        for _, _, dtype in entries:
            if dtype not in dtypes:
                dtypes.append(dtype)
        for dtype in dtypes:
            flat = torch.cat([state[n].reshape(-1) for n, _, d in entries if d == dtype])
            work = self._group.broadcast(flat, 0)
            self._pending_works.append((work, [flat]))

    # ----------------------------------------------------------------- jobs
    def _submit(
        self, kind: str, args: tuple, params: SamplingParams, seed: int | None = None
    ) -> Job:
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        # The worker seeds each job: from params.seed, else from torch's generator here, so a
        # run that checkpoints torch's RNG state resumes with the very samples it would draw
        # (``seed``: a pool's part seed, drawn the same way).
        if seed is None:
            seed = draw_seed(params)
        job = Job(next(self._jobs), self.version, kind)
        self._commands.put((kind, job.id, seed, args))
        return job

    def submit(self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams):
        """Queue sampling ``params.num_samples`` responses per prompt (as :meth:`generate`);
        returns the :class:`Job`, whose rollout :meth:`collect` returns."""
        return self._submit("generate", (self._encode(prompts), params), params)

    def submit_episodes(
        self,
        problems: Sequence[Any],
        params: SamplingParams,
        *,
        max_turns: int,
        max_tokens: int,
        skip_env_errors: bool = False,
    ) -> Job:
        """Queue the multi-turn episodes of ``problems`` (as :meth:`run_episodes`, each row's
        environment ``env_maker(problem)``, built in the worker)."""
        if not self._has_env_maker:
            raise ValueError("submit_episodes needs the env_maker given to AsyncRollout")
        limits = dict(max_turns=max_turns, max_tokens=max_tokens, skip_env_errors=skip_env_errors)
        return self._submit("episodes", (list(problems), params, limits), params)

    def collect(self, job: Job) -> Rollout:
        """The rollout of ``job`` (waiting for it); its batch carries ``policy_version``."""
        return self._collect(job)[0]

    def _collect(self, job: Job) -> tuple[Any, tuple[float, float]]:
        """:meth:`collect`, and the worker's wall and CPU seconds for the job."""
        self._check_open()
        while job.id not in self._done:
            self._receive(f"the rollout of job {job.id} (policy version {job.version})")
        version, payload, seconds = self._done.pop(job.id)
        if version != job.version:  # the queue's order is the versions' contract
            raise WorkerError(
                f"{self.name} sampled job {job.id} with policy version {version}, but "
                f"version {job.version} was the last pushed before it"
            )
        if job.kind == "sample":
            return payload, seconds
        rows = len(payload["texts"])
        batch = TensorDict(payload["batch"], batch_size=[rows])
        batch[POLICY_VERSION_KEY] = torch.full((rows,), version, dtype=torch.long)
        rollout = Rollout(
            batch=batch,
            texts=payload["texts"],
            group_ids=payload["group_ids"],
            rewards=payload["rewards"],
            num_turns=payload["num_turns"],
            metrics=payload["metrics"],
        )
        return rollout, seconds

    def poll(self) -> None:
        """Handle what the worker has sent so far (checks of finished syncs; errors) without
        waiting."""
        self._check_open()
        while True:
            try:
                message = self._results.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def generate(self, prompts, params: SamplingParams) -> Rollout:
        """Sample now, at the latest pushed version (submit + collect)."""
        return self.collect(self.submit(prompts, params))

    def run_episodes(self, prompts, make_env, params, **limits) -> Rollout:
        """Not here: see :meth:`submit_episodes` (a ``make_env`` closure cannot reach the
        worker process)."""
        raise TypeError(
            "AsyncRollout plays episodes in its worker process, where a make_env closure cannot "
            "go: use submit_episodes(problems, ...) with the env_maker given at construction"
        )

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        return self.collect(self._submit("sample", (prompt_ids, params), params))

    # ----------------------------------------------------------------- messages
    def _wait_for(self, kind: str, what: str) -> None:
        while True:
            message = self._next_message(what)
            if message[0] == kind:
                return
            self._handle(message)

    def _wait_for_sync(self, version: int) -> None:
        while version not in self.sync_stats:
            self._receive(f"the check of the weights of policy version {version}")

    def _receive(self, what: str) -> None:
        self._handle(self._next_message(what))

    def _next_message(self, what: str):
        """The worker's next message; :class:`WorkerError` when it died or sent nothing for
        ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                pass
            if not self.process.is_alive():
                with contextlib.suppress(queue.Empty):  # its last words, if it had time
                    message = self._results.get(timeout=1.0)
                    if message[0] == "error":
                        self._handle(message)
                    return message
                raise WorkerError(
                    f"{self.name} (pid {self.process.pid}) died with exit code "
                    f"{self.process.exitcode} while the trainer waited for {what}"
                )
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{self.name} (pid {self.process.pid}) sent nothing for {self.timeout_s:.0f} "
                    f"s while the trainer waited for {what} (timeout_s; "
                    "rollout.worker_timeout_s in the recipes)"
                )

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "done":
            _, job, version, payload, (seconds, cpu_seconds) = message
            self._done[job] = (version, loads(payload), (seconds, cpu_seconds))
            self.job_seconds.append(seconds)
            self.job_cpu_seconds.append(cpu_seconds)
        elif kind == "synced":
            _, version, probe, sums, seconds = message
            self.sync_seconds.append(seconds)
            self._verify(version, loads(probe), sums)
        elif kind == "job_error":
            raise loads(message[2])
        elif kind == "error":
            raise WorkerError(f"{self.name} failed:\n{message[1]}")
        elif kind in ("hello", "ready"):
            raise WorkerError(f"{self.name} sent an unexpected {kind!r}")

    def _verify(self, version: int, probe: torch.Tensor, sums: dict) -> None:
        expected_probe, expected_sums = self._expected.pop(version)
        stats = probe_stats(expected_probe, probe, self.probe["loss_mask"].cpu())
        self.sync_stats[version] = stats
        differ = [n for n in expected_sums if checksums_differ(expected_sums[n], sums.get(n))]
        if differ or sync_check_fails(stats, self.sync_check_tol):
            tensors = (
                "tensors that differ: "
                + ", ".join(f"{tensor_family(n)} ({n})" for n in differ[:6])
                + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
                if differ
                else "every tensor's checksum agrees: the forwards differ (dtype, kernels); "
                "raise the tolerance if that is expected"
            )
            raise sync_check_error(version, self.name, stats, self.sync_check_tol, tensors)

    # ----------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise WorkerError(f"{self.name} is closed")


def sync_check_error(
    version: int, target: str, stats: dict[str, float], tol: float, detail: str
) -> SyncCheckError:
    """The error of a push to ``target`` whose probe (``stats``, :func:`probe_stats`) or tensors
    failed the check: it names the version, the step whose weights they are, the difference
    against ``tol`` (``rollout.sync_check_tol``) and ``detail`` (what differs, or was pushed)."""
    return SyncCheckError(
        f"the weight sync of policy version {version} (the weights after step {version}) to "
        f"{target} failed its check: probe log-probs differ by "
        f"{stats[SYNC_CHECK_STAT]:.3g} on average ({SYNC_CHECK_STAT}, the mean |difference| "
        f"over the probe's tokens; tolerance {tol:g}, rollout.sync_check_tol; at most "
        f"{stats['sync/probe_abs_diff_max']:.3g}, k3 KL {stats['sync/probe_kl']:.3g}); {detail}"
    )


def warn_if_oversubscribed(names: str, worker_threads: Sequence[int]) -> bool:
    """Log a warning when the trainer's torch threads and the workers' (``worker_threads``, 0:
    torch's default) exceed the cores; True when it warned."""
    trainer = torch.get_num_threads()
    cores = os.cpu_count() or 1
    threads = trainer + sum(n or trainer for n in worker_threads)
    if threads <= cores:
        return False
    logger.warning(
        "the trainer's %d torch threads and the torch threads of %s (%s) take %d threads on "
        "%d cores: "
        "OpenMP threads spinning on oversubscribed cores can slow both processes many "
        "times over (torch.set_num_threads; train.num_threads in the recipes)",
        trainer,
        names,
        " + ".join(str(n or "default") for n in worker_threads),
        threads,
        cores,
    )
    return True


def gather_weights(module, prefix: str, *, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The causal LM's full tensors (FSDP2 shards all-gathered on every rank, as the vllm
    backend's sync does), on the CPU, by their names in the causal LM (``prefix``: its path in
    ``module``, :func:`~microrl.engine.checkpoint.export.locate_base_model`). Collective under
    ``torchrun``; one full tensor at a time on a GPU (:func:`gather_full_weights`)."""
    return gather_full_weights(module, prefix, trainable_only=trainable_only)


def probe_stats(expected: torch.Tensor, actual: torch.Tensor, mask: torch.Tensor) -> dict:
    """The statistics of ``d = expected - actual`` over the probe's tokens (``mask``), from the
    trainer's and the sampler's log-prob sets ``[B, T]``, in float64: ``sync/probe_kl`` (the
    mean k3 estimator ``exp(d) - 1 - d``), ``sync/probe_abs_diff_max`` and
    ``sync/probe_abs_diff_mean`` (:data:`SYNC_CHECK_STAT`, what the check bounds)."""
    delta = (expected.double() - actual.double())[mask]
    return {
        "sync/probe_kl": float((torch.expm1(delta) - delta).mean()),
        "sync/probe_abs_diff_max": float(delta.abs().max()),
        SYNC_CHECK_STAT: float(delta.abs().mean()),
    }


def sync_check_fails(stats: dict[str, float], tol: float) -> bool:
    """Whether a push's probe :func:`probe_stats` fail the check: :data:`SYNC_CHECK_STAT` above
    ``tol`` (or not a number)."""
    return not stats[SYNC_CHECK_STAT] <= tol


def default_sync_check_tol(engine) -> float:
    """The default ``sync_check_tol`` of ``engine``'s precision (:data:`FP32_SYNC_CHECK_TOL`,
    :data:`LOW_PRECISION_SYNC_CHECK_TOL`)."""
    autocast = engine_autocast_dtype(engine) is not None
    full_precision = setup.base_dtype(engine.config).itemsize >= 4 and not autocast
    return FP32_SYNC_CHECK_TOL if full_precision else LOW_PRECISION_SYNC_CHECK_TOL


def _stop_worker(process: multiprocessing.Process, commands, results) -> None:
    """Ask the worker to exit (it answers between jobs), then terminate, then kill; close the
    queues."""
    if process.is_alive():
        with contextlib.suppress(Exception):
            commands.put(("close",))
        process.join(timeout=3)  # an idle worker exits at once; a busy one is stopped
    if process.is_alive():
        process.terminate()
        with contextlib.suppress(OSError):  # a stopped (SIGSTOP) process gets the SIGTERM now
            os.kill(process.pid, signal.SIGCONT)
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
    for q in (commands, results):
        with contextlib.suppress(Exception):
            q.cancel_join_thread()
            q.close()
