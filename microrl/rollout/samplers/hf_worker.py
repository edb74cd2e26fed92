"""Asynchronous ``hf`` rollouts: a generation worker process that samples while the trainer trains.

:class:`AsyncRollout` spawns one worker (:mod:`microrl.rollout.worker.main`) holding its own
copy of the policy. Jobs run one after the other in submission order and a weight push is
queued between them like a job, so the version a job samples is known when it is submitted;
every row carries it (``policy_version``). The first push streams every tensor of the model in
chunks (no process holds a second copy on the host); later ones send what the optimizer changes,
packed once and broadcast asynchronously (:class:`~microrl.rollout.weights.gloo.GlooBroadcast`).
Every push is verified: the worker scores the probe batch and checksums every tensor it
received; the trainer compares both with its own when the answer arrives and raises
``SyncCheckError`` naming the version and the tensors. Every wait polls the worker's liveness
and gives up after ``timeout_s``; ``close`` (also at exit) stops it.
"""

from __future__ import annotations

import contextlib
import copy
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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

from microrl.engine import setup
from microrl.engine.checkpoint.export import locate_base_model
from microrl.engine.parallel import distributed
from microrl.engine.parallel.ulysses_attention import base_implementation
from microrl.rollout import watcher
from microrl.rollout.base import (
    Rollout,
    SamplingParams,
    check_tokenizer,
    draw_seed,
    encode_prompts,
)
from microrl.rollout.channel import ChannelClosed, Receiver, Sender, close_all, start_process
from microrl.rollout.images import check_image_prompts
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, Sampler, WorkerError
from microrl.rollout.samplers.hf import engine_autocast_dtype
from microrl.rollout.weights.full_weights import FullWeights
from microrl.rollout.weights.gloo import GlooBroadcast
from microrl.rollout.weights.sync_check import engine_probe
from microrl.rollout.weights.weight_sync import ProbeVerifier, WeightSync
from microrl.rollout.worker import stream
from microrl.rollout.worker.main import (
    WorkerSpec,
    checksums_differ,
    dumps,
    loads,
    tensor_checksums,
    tensor_family,
    worker_main,
)
from microrl.rollout.worker.stream import (
    Entry,
    Packed,
    check_layout,
    pack,
    send_chunks,
    send_stream,
)

if TYPE_CHECKING:  # annotations only
    from microrl.rollout.sampler import SamplerOptions

__all__ = ["AsyncRollout"]

logger = logging.getLogger(__name__)


class AsyncRollout(Sampler):
    """The ``hf`` backend in a worker process: submit jobs now, collect their rollouts later.

    Args:
        engine: the :class:`~microrl.engine.ActorEngine` whose policy is sampled; its weights
            now are pushed as ``version``.
        tokenizer: its tokenizer (picklable: it is sent to the worker).
        options: the policy version of the engine's current weights, the environments, the
            timeout, the check's tolerance and the worker's threads
            (:class:`~microrl.rollout.sampler.SamplerOptions`; None: the defaults).
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
        options: SamplerOptions | None = None,
        *,
        name: str | None = None,
        wait: bool = True,
        check_threads: bool = True,
    ) -> None:
        self.tokenizer = check_tokenizer(tokenizer)
        options = self._take_options(engine, options)
        self.engine = engine
        self.name = name or (
            f"the rollout worker of rank {distributed.rank()}"
            if distributed.is_distributed()
            else "the rollout worker"
        )
        #: The :func:`probe_stats` of each verified push, by version.
        self.sync_stats: dict[int, dict[str, float]] = {}
        #: The worker's seconds per job and per weight load (+ probe), in the order they ran,
        #: and its CPU seconds per job (less than the wall time: it waited for a core).
        self.job_seconds: list[float] = []
        self.job_cpu_seconds: list[float] = []
        self.sync_seconds: list[float] = []
        #: Where the causal LM sits in the engine's module (its tensors are named from there).
        self.prefix, base = locate_base_model(engine.module)
        self.probe = engine_probe(engine, tokenizer)
        self._expected: dict[int, tuple[torch.Tensor, dict[str, tuple[float, ...]]]] = {}
        self._done: dict[int, tuple[int, Any, tuple[float, float]]] = {}
        self._jobs = itertools.count()
        self._pending_works: list[tuple[Any, list[torch.Tensor]]] = []
        self._closed = False
        self.process = None
        env_bytes = None
        if self.env_maker is not None:
            try:
                env_bytes = dumps(self.env_maker)
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                raise ValueError(
                    "env_maker cannot be sent to the rollout worker process (it must be "
                    f"picklable, e.g. a task's make_env): {err}"
                ) from err
        if check_threads:
            warn_if_oversubscribed(self.name, [options.num_threads])
        #: How each sync reaches the worker: over its gloo group.
        self.weight_sync: WeightSync = GlooBroadcast([self])
        self._spawn(engine, base, tokenizer, env_bytes, options)
        if wait:
            self.wait_started()

    # ----------------------------------------------------------------- start and stop
    def _spawn(self, engine, base, tokenizer, env_bytes, options: SamplerOptions) -> None:
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = TCPStore(
            "127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False, timeout=timeout
        )
        device = engine.device  # the compute device (parameters may be offloaded to the host)
        spec = WorkerSpec(
            name=self.name,
            model_config=unwrapped_attention(base.config),
            lora=engine.config.lora,
            tokenizer=tokenizer,
            temperature=float(engine.config.temperature),
            probe={k: v.cpu() for k, v in self.probe.items()},
            store_port=self._store.port,
            timeout_s=self.timeout_s,
            num_threads=options.num_threads,
            device="cpu" if device.type == "cpu" else str(device),
            env_maker=env_bytes,
            base_dtype=setup.base_dtype(engine.config),
            autocast_dtype=engine_autocast_dtype(engine),
            image_encoder=self.image_encoder,
            freeze_vision=bool(getattr(engine.config, "freeze_vision", True)),
            record_routing=options.record_routing,
        )
        self.process, self._commands, self._results = start_process(
            mp.get_context("spawn"),
            worker_main,
            (spec,),
            name="microrl-rollout-worker",
            daemon=True,  # stopped at the trainer's exit; the watcher stops it if it is killed
        )
        watcher.watch("process", self.process.pid, label=self.name)
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
            self._layouts = {
                "full": self._layout(engine, trainable_only=False),
                "trainable": self._layout(engine, trainable_only=True),
            }
            self._send(("layout", self._layouts), "its layout")
            self._wait_for("ready", "it to check the model's tensors")
            self._stream_full(engine)
            self._wait_for_sync(self.version)
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

    def request_stop(self) -> None:
        """Ask a live worker to exit once idle, without waiting (a pool asks all before closing
        each)."""
        if self.process is not None and self.process.is_alive():
            with contextlib.suppress(ChannelClosed):
                self._commands.put(("close",))

    # ----------------------------------------------------------------- weights
    def _layout(self, engine, *, trainable_only: bool) -> list[Entry]:
        """``(name, shape, dtype)`` of each tensor a push of this kind sends (no gather)."""
        weights = FullWeights(engine.module, self.prefix, trainable_only=trainable_only)
        return [(name, shape, dtype) for name, dtype, shape in weights.metadata()]

    def _stream_full(self, engine) -> None:
        """The first push: every tensor, gathered one at a time and streamed in chunks
        (:func:`~microrl.rollout.worker.stream.send_stream`), so neither process holds a second
        copy of the model on the host; then the engine's probe log-probs, what the worker must
        answer. Synchronous: the start waits for the worker's check anyway."""
        entries = self._layouts["full"]
        chunk = stream.CHUNK_BYTES
        self._send(("weights", self.version, "full", chunk), "the first weights")
        weights = FullWeights(engine.module, self.prefix)
        checksums = send_stream(weights, entries, self._broadcast_chunk, chunk)
        self._expected[self.version] = (self._probe_logprobs(engine), checksums)

    def _broadcast_chunk(self, chunk: torch.Tensor):
        return self._group.broadcast(chunk, 0)

    def sync(self, engine=None) -> None:
        """Push the engine's current weights as the next version (``version + 1``) through
        :attr:`weight_sync`; jobs submitted from now on sample them. Returns at once: the worker
        loads them after the jobs before; the check of this push runs when its answer arrives
        (:meth:`collect`, :meth:`poll`). Collective under ``torchrun`` (the weights are
        gathered)."""
        self._check_open()
        self.weight_sync.push(engine or self.engine, self.version + 1)

    def pack(self, engine) -> Packed:
        """The trainable tensors, gathered one at a time into one host buffer
        (:func:`~microrl.rollout.worker.stream.pack`). Collective under ``torchrun``."""
        entries = self._layouts["trainable"]
        weights = FullWeights(engine.module, self.prefix, trainable_only=True)
        check_layout(self._layout(engine, trainable_only=True), entries, self.name)
        return pack(weights, entries)

    def push_version(
        self,
        engine,
        state: Packed | Mapping[str, torch.Tensor],
        version: int,
        expected=None,
    ) -> None:
        """Send ``state`` (the trainable tensors: :meth:`pack`'s, or gathered by name) as
        ``version``; ``expected``: its :meth:`expected_of` when the caller computed it (a pool:
        once for all its workers)."""
        self._check_open()
        entries = self._layouts["trainable"]
        if not isinstance(state, Packed):
            check_layout(
                [(n, tuple(t.shape), t.dtype) for n, t in state.items()], entries, self.name
            )
            state = pack(state.items(), entries)
        self.version = version
        self._expected[version] = expected or self.expected_of(engine, state)
        self._send(
            ("weights", version, "trainable", stream.CHUNK_BYTES),
            f"the weights of version {version}",
        )
        self._broadcast(state.buffer, stream.CHUNK_BYTES)

    def expected_of(self, engine, state: Packed | Mapping[str, torch.Tensor]):
        """What the worker must answer to a push of ``state``: the engine's probe log-probs
        now and the tensors' checksums."""
        sums = state.checksums if isinstance(state, Packed) else tensor_checksums(state.items())
        return self._probe_logprobs(engine), sums

    def _probe_logprobs(self, engine) -> torch.Tensor:
        return engine.infer_batch(self.probe)["logprobs"].float().cpu()

    def _broadcast(self, buffer: torch.Tensor, chunk_bytes: int) -> None:
        """A packed push's chunks, broadcast asynchronously (the worker receives them when it
        reaches the ``weights`` command): the trainer does not wait for the worker here; the
        buffer is kept until every chunk has left."""
        self._pending_works = [(w, b) for w, b in self._pending_works if not w.is_completed()]
        for work in send_chunks(buffer, self._broadcast_chunk, chunk_bytes):
            self._pending_works.append((work, [buffer]))

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
        self._send((kind, job.id, seed, args), f"job {job.id}")
        return job

    def submit(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        images: Sequence[Sequence[Any]] | None = None,
        seed: int | None = None,
    ) -> Job:
        """Queue sampling ``params.num_samples`` responses per prompt (``HFRollout.generate``
        in the worker); returns the :class:`Job`, whose rollout :meth:`collect` returns.
        ``images``: each text prompt's PIL images, sent with the job and encoded in the worker
        by the policy's :class:`~microrl.rollout.images.ImageEncoder` (the one
        preprocessing path). ``seed``: the job's seed (a pool's part seed); None:
        :func:`draw_seed`."""
        if images is not None:
            check_image_prompts(self, prompts, images)
            args = (list(prompts), params, [list(row) for row in images])
            return self._submit("generate", args, params, seed)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        return self._submit("generate", (prompt_ids, params, None), params, seed)

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        """The episodes run in the worker (``HFRollout.run_episodes``), each row's environment
        built there by ``env_maker``."""
        return self._submit("episodes", (problems, params, limits), params, seed)

    def collect(self, job: Job) -> Rollout:
        """The rollout of ``job`` (waiting for it); its batch carries ``policy_version``."""
        return self.collect_timed(job)[0]

    def collect_timed(self, job: Job) -> tuple[Rollout, tuple[float, float]]:
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
            except ChannelClosed:
                raise self._died("its next message") from None
            self._handle(message)

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
        """The worker's next message; :class:`WorkerError` when it died (at any point, also in
        the middle of a message: its end of the pipe closes) or sent nothing for
        ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                pass
            except ChannelClosed:
                raise self._died(what) from None
            if not self.process.is_alive():  # dead, its pipe held open by a process it started
                raise self._died(what)
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{self.name} (pid {self.process.pid}) sent nothing for {self.timeout_s:.0f} "
                    f"s while the trainer waited for {what} (timeout_s; "
                    "rollout.worker_timeout_s in the recipes)"
                )

    def _send(self, command: tuple, what: str) -> None:
        try:
            self._commands.put(command)
        except ChannelClosed:
            raise self._died(f"it to take {what}") from None

    def _died(self, what: str) -> WorkerError:
        """The error of a worker whose channel closed: its exit code, once the process is
        reaped (a moment after its pipe closes)."""
        self.process.join(timeout=5)
        return WorkerError(
            f"{self.name} (pid {self.process.pid}) died with exit code "
            f"{self.process.exitcode} while the trainer waited for {what}"
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
        differ = [n for n in expected_sums if checksums_differ(expected_sums[n], sums.get(n))]
        tensors = (
            "tensors that differ: "
            + ", ".join(f"{tensor_family(n)} ({n})" for n in differ[:6])
            + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
            if differ
            else "every tensor's checksum agrees: the forwards differ (dtype, kernels); "
            "raise the tolerance if that is expected"
        )
        verifier = ProbeVerifier.of(self)
        verifier.verify(version, self.name, expected_probe, probe, tensors, failed=bool(differ))

    # ----------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise WorkerError(f"{self.name} is closed")


def unwrapped_attention(config):
    """A copy of the model ``config`` whose attention is the plain one the engine's wrappers
    (sequence parallelism's Ulysses, packing's varlen) run: the worker's model samples whole,
    unpacked rows in its own process, where those wrappers are not registered."""
    config = copy.deepcopy(config)
    name = getattr(config, "_attn_implementation", None)
    while (plain := base_implementation(name)) != name:
        name = plain
    if name is not None:
        config._attn_implementation = name
    return config


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


def _stop_worker(process: multiprocessing.Process, commands: Sender, results: Receiver) -> None:
    """Ask the worker to exit (it answers between jobs), then terminate, then kill; close the
    channels."""
    if process.is_alive():
        with contextlib.suppress(ChannelClosed):
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
    close_all(commands, results)
    if not process.is_alive():
        watcher.release("process", process.pid)
