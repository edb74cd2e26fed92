"""Asynchronous ``hf`` rollouts: a generation worker process that samples while the trainer trains.

:class:`AsyncRollout` spawns one worker (:mod:`microrl.rollout.worker.main`) with its own copy
of the policy. Jobs and weight pushes run in submission order, so a job's version is known when
it is submitted; each push is checked by the worker's probe log-probs and tensor checksums
(``SyncCheckError``). docs/async.md.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import pickle
import queue
import re
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as mp
from tensordict import TensorDict
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from microrl.engine import setup
from microrl.engine.checkpoint.export import locate_base_model
from microrl.engine.parallel import distributed
from microrl.engine.parallel.ulysses_attention import base_implementation
from microrl.rollout import watcher
from microrl.rollout.base import Images, Prompts, Rollout, SamplingParams
from microrl.rollout.channel import ChannelClosed, Receiver, Sender, start_process
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, WorkerError, WorkerSampler
from microrl.rollout.samplers.hf import engine_autocast_dtype
from microrl.rollout.weights.full_weights import FullWeights
from microrl.rollout.weights.gloo import GlooBroadcast
from microrl.rollout.weights.weight_sync import ProbeVerifier, WeightSync
from microrl.rollout.worker import stream
from microrl.rollout.worker.main import WorkerSpec, tensor_checksums, worker_main

if TYPE_CHECKING:  # annotations only
    from microrl.engine.base import Engine
    from microrl.rollout.sampler import SamplerOptions

__all__ = ["AsyncRollout"]

logger = logging.getLogger(__name__)


class AsyncRollout(WorkerSampler):
    """The ``hf`` backend in a worker process: submit jobs now, collect their rollouts later.

    Args:
        engine: the :class:`~microrl.engine.ActorEngine` sampled; its weights are ``version``.
        tokenizer: its tokenizer (picklable: it is sent to the worker).
        options: :class:`~microrl.rollout.sampler.SamplerOptions` (None: the defaults).
        name: how errors name the worker.
        wait: False: return once spawned; :meth:`wait_started` completes the start.
        check_threads: warn when the trainer's and the worker's threads oversubscribe the cores.

    Under ``torchrun`` each rank owns one (its own worker); :meth:`sync` is collective.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        options: SamplerOptions | None = None,
        *,
        name: str | None = None,
        wait: bool = True,
        check_threads: bool = True,
    ) -> None:
        options = self._start(engine, tokenizer, options)
        rank = f" of rank {distributed.rank()}" if distributed.is_distributed() else ""
        self.name = name or f"the rollout worker{rank}"
        #: The worker's CPU seconds per job (less than the wall time: it waited for a core).
        self.job_cpu_seconds: list[float] = []
        #: Where the causal LM sits in the engine's module (its tensors are named from there).
        self.prefix, base = locate_base_model(engine.module)
        self._expected: dict[int, tuple[torch.Tensor, dict[str, tuple[float, ...]]]] = {}
        self._done: dict[int, tuple[int, Any, tuple[float, float]]] = {}
        self._pending_works: list[tuple[Any, torch.Tensor]] = []  # a work and what it sends
        self.process = None
        env_bytes = None
        if self.env_maker is not None:
            try:
                env_bytes = pickle.dumps(self.env_maker)
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                raise ValueError(
                    "env_maker cannot be sent to the rollout worker process (it must be "
                    f"picklable, e.g. a task's make_env): {err}"
                ) from err
        if check_threads:
            warn_if_oversubscribed(self.name, [options.num_threads])
        self.weight_sync: WeightSync = GlooBroadcast([self])
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = TCPStore(
            "127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False, timeout=timeout
        )
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
            device="cpu" if engine.device.type == "cpu" else str(engine.device),
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
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Complete the start (``wait=False``): push the engine's weights as ``version`` and
        check them; closes the worker on failure."""
        engine = self.engine
        try:
            self._check_open()
            self._receive("it to start", until="hello")
            store = PrefixStore("microrl-rollout", self._store)
            self._group = ProcessGroupGloo(store, 0, 2, self._store.timeout)
            self._layouts = {  # (name, shape, dtype) of each tensor a push of a kind sends
                kind: [(n, s, d) for n, d, s in self._weights(engine, kind).metadata()]
                for kind in ("full", "trainable")
            }
            self._send(("layout", self._layouts), "its layout")
            self._receive("it to check the model's tensors", until="ready")
            # The first push: every tensor, gathered one at a time and streamed in chunks, so no
            # process holds a second host copy; synchronous (the start waits for its check anyway).
            chunk = stream.CHUNK_BYTES
            self._send(("weights", self.version, "full", chunk), "the first weights")
            sums = stream.send_stream(
                self._weights(engine, "full"), self._layouts["full"], self._broadcast_chunk, chunk
            )
            self._expected[self.version] = (self._probe_logprobs(engine), sums)
            while self.version not in self.sync_stats:
                self._receive(f"the check of the weights of policy version {self.version}")
        except BaseException:
            self.close()
            raise

    def _close(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:  # first: a live worker still takes a push in flight
            finalizer()
        group = getattr(self, "_group", None)
        if group is not None:
            with contextlib.suppress(Exception):
                group.abort()  # a push to a worker that died must not block the exit
        self._pending_works.clear()

    def request_stop(self) -> None:
        """Ask a live worker to exit once idle, without waiting (a pool asks all at once)."""
        if self.process is not None and self.process.is_alive():
            with contextlib.suppress(ChannelClosed):
                self._commands.put(("close",))

    def _weights(self, engine, kind: str) -> FullWeights:
        """``engine``'s tensors a push of ``kind`` (``"full"`` or ``"trainable"``) sends."""
        return FullWeights(engine.module, self.prefix, trainable_only=kind == "trainable")

    def _broadcast_chunk(self, chunk: torch.Tensor):
        return self._group.broadcast(chunk, 0)

    def _push(self, engine, version: int) -> None:
        self.weight_sync.push(engine, version)  # collective under torchrun: a gather

    def pack(self, engine) -> stream.Packed:
        """The trainable tensors, gathered one at a time into one host buffer (collective;
        ``RuntimeError``: a tensor out of layout)."""
        return stream.pack(self._weights(engine, "trainable"), self._layouts["trainable"])

    def push_version(
        self, engine, state: stream.Packed | Mapping[str, torch.Tensor], version: int, expected=None
    ) -> None:
        """Send ``state`` (the trainable tensors: :meth:`pack`'s, or by name) as ``version``;
        ``expected``: its :meth:`expected_of` when the caller computed it (a pool: once)."""
        self._check_open()
        if not isinstance(state, stream.Packed):
            state = stream.pack(state.items(), self._layouts["trainable"])
        self.version = version
        self._expected[version] = expected or self.expected_of(engine, state)
        chunk = stream.CHUNK_BYTES
        self._send(("weights", version, "trainable", chunk), f"the weights of version {version}")
        self._broadcast(state.buffer, chunk)

    def expected_of(self, engine, state: stream.Packed | Mapping[str, torch.Tensor]):
        """What the worker must answer to a push of ``state``: the probe's log-probs, checksums."""
        sums = (
            state.checksums if isinstance(state, stream.Packed) else tensor_checksums(state.items())
        )
        return self._probe_logprobs(engine), sums

    def _probe_logprobs(self, engine) -> torch.Tensor:
        return engine.infer_batch(self.probe)["logprobs"].float().cpu()

    def _broadcast(self, buffer: torch.Tensor, chunk_bytes: int) -> None:
        """A packed push's chunks, broadcast without waiting; the buffer is kept until they left."""
        self._pending_works = [(w, b) for w, b in self._pending_works if not w.is_completed()]
        for work in stream.send_chunks(buffer, self._broadcast_chunk, chunk_bytes):
            self._pending_works.append((work, buffer))

    def _submit(self, kind: str, args: tuple, params: SamplingParams, seed: int | None) -> Job:
        job, seed = self._new_job(kind, params, seed)  # the worker seeds the job with it
        self._send((kind, job.id, seed, args), f"job {job.id}")
        return job

    def submit(
        self,
        prompts: Prompts,
        params: SamplingParams,
        *,
        images: Images = None,
        seed: int | None = None,
    ) -> Job:
        """``HFRollout.generate`` in the worker, which encodes the ``images``; ``seed``: the
        job's seed (a pool's part seed; None: drawn here)."""
        prompts, images = self._job_prompts(prompts, images)
        return self._submit("generate", (prompts, params, images), params, seed)

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        return self._submit("episodes", (problems, params, limits), params, seed)

    def collect(self, job: Job) -> Rollout:
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
        rows = len(payload["texts"])  # a Rollout's fields, its batch a dict (worker.main)
        batch = payload["batch"] = TensorDict(payload["batch"], batch_size=[rows])
        batch[POLICY_VERSION_KEY] = torch.full((rows,), version, dtype=torch.long)
        return Rollout(**payload), seconds

    def poll(self) -> None:
        self._check_open()
        while (message := self._next_message("its next message", wait=False)) is not None:
            self._handle(message)

    def _receive(self, what: str, until: str | None = None) -> None:
        """Handle the worker's next message, or (``until``) each one before one of that kind."""
        while (message := self._next_message(what))[0] != until:
            self._handle(message)
            if until is None:
                return

    def _next_message(self, what: str, wait: bool = True):
        """The worker's next message (``wait=False``: None unless one is here whole);
        :class:`WorkerError` when it died or sent nothing for ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                timeout = min(1.0, max(0.01, deadline - time.monotonic())) if wait else 0
                return self._results.get(timeout=timeout)
            except queue.Empty:
                if not wait:
                    return None
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
        self.process.join(timeout=5)
        return WorkerError(
            f"{self.name} (pid {self.process.pid}) died with exit code "
            f"{self.process.exitcode} while the trainer waited for {what}"
        )

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "done":
            _, job, version, payload, (seconds, cpu_seconds) = message
            self._done[job] = (version, payload, (seconds, cpu_seconds))
            self.job_seconds.append(seconds)
            self.job_cpu_seconds.append(cpu_seconds)
        elif kind == "synced":
            _, version, probe, sums, seconds = message
            self.sync_seconds.append(seconds)
            self._verify(version, probe, sums)
        elif kind == "job_error":
            raise message[2]
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


def checksums_differ(a: tuple[float, ...] | None, b: tuple[float, ...] | None) -> bool:
    """Whether two :func:`tensor_checksums` entries differ beyond float64 rounding (relative
    1e-9 of the sums of magnitudes, which bound the rounding error)."""
    if a is None or b is None:
        return True
    (sum_a, squares_a, magnitude_a), (sum_b, squares_b, magnitude_b) = a, b
    return (
        abs(sum_a - sum_b) > 1e-9 * magnitude_a
        or abs(squares_a - squares_b) > 1e-9 * squares_a
        or abs(magnitude_a - magnitude_b) > 1e-9 * magnitude_a
    )


def tensor_family(name: str) -> str:
    """A readable parameter name: ``...layers.1.self_attn.q_proj.lora_A.default.weight`` ->
    ``lora_A of layer 1 self_attn.q_proj``."""
    match = re.search(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.(.+)$", name)
    where, rest = (f"layer {match.group(1)} ", match.group(2)) if match else ("", name)
    parts = rest.split(".")
    lora = next((p for p in parts if p.startswith("lora_")), None)
    skip = {"default", "base_layer", "weight"}
    module = ".".join(p for p in parts if p not in skip and not p.startswith("lora_"))
    if lora is not None:
        return f"{lora} of {where}{module}"
    return f"{where}{module}".strip() or name


def unwrapped_attention(config):
    """A copy of the model ``config`` with the plain attention the engine's wrappers (Ulysses,
    varlen) run: the worker's process samples whole rows and registers no wrapper."""
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
        "%d cores: OpenMP threads spinning on oversubscribed cores can slow both processes many "
        "times over (torch.set_num_threads; train.num_threads in the recipes)",
        trainer,
        names,
        " + ".join(str(n or "default") for n in worker_threads),
        threads,
        cores,
    )
    return True


def _stop_worker(process: mp.Process, commands: Sender, results: Receiver) -> None:
    """Ask the worker to exit, then terminate, then kill; close the channels."""
    if process.is_alive():
        with contextlib.suppress(ChannelClosed):
            commands.put(("close",))
        process.join(timeout=3)  # an idle worker exits at once; a busy one is stopped
    if process.is_alive():
        watcher.stop([("process", process.pid)])  # our child: its pid is not reused unreaped
        process.join(timeout=5)
    for end in (commands, results):
        with contextlib.suppress(Exception):
            end.close()
    if not process.is_alive():
        watcher.release("process", process.pid)
