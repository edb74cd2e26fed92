"""The generation worker process of ``AsyncRollout`` (docs/async.md): ``HFRollout`` on its own
copy of the model. Weights come over a private two-rank gloo group; the rest as tuples named by
their first item:

- trainer -> worker: ``("layout", layouts)`` once; ``("weights", version, layout, chunk_bytes)``;
  ``("generate" | "episodes", job, seed, args)``; ``("close",)``.
- worker -> trainer: ``("hello", pid)``, ``("ready",)``, ``("synced", version, probe_logprobs,
  checksums, seconds)``, ``("done", job, version, payload, seconds)``, ``("job_error", job,
  error)``, ``("error", traceback)`` (fatal).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from microrl.rollout.channel import ChannelClosed, Receiver, Sender
from microrl.rollout.worker.stream import receive_stream, tensor_checksum

__all__ = ["WorkerSpec", "build_sampler", "score_probe", "tensor_checksums", "worker_main"]

# torchrun's variables: the worker is not a data-parallel rank and must never join that group.
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass
class WorkerSpec:
    """What a worker needs to build its copy of the policy (pickled to the spawned process)."""

    name: str
    model_config: Any  # the trainer's transformers config
    lora: Any  # the engine's LoraConfig (rank 0: none)
    tokenizer: Any
    temperature: float
    probe: dict[str, torch.Tensor]
    store_port: int
    timeout_s: float
    num_threads: int = 1
    device: str = "cpu"
    env_maker: bytes | None = None  # pickled callable: Problem -> environment (multi-turn tasks)
    store_host: str = "127.0.0.1"
    # The engine's precision: the base's storage dtype and its forwards' autocast (None: none).
    base_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    image_encoder: Any = None  # a vision-language policy's; None: text jobs only
    freeze_vision: bool = True  # the engine's: a frozen tower gets no LoRA adapter
    record_routing: bool = False  # rollout.routing_replay: rows carry routed_experts


def tensor_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[float, ...]]:
    """Per tensor ``(sum, sum of squares, sum of |x|)`` in float64 (compared by the trainer's
    :func:`~microrl.rollout.samplers.hf_worker.checksums_differ`)."""
    return {name: tensor_checksum(tensor) for name, tensor in named}


@torch.no_grad()
def score_probe(
    model: torch.nn.Module,
    probe: Mapping[str, torch.Tensor],
    temperature: float,
    autocast_dtype: torch.dtype | None = None,
):
    """The model's log-probs of the probe's tokens at ``temperature``, token-aligned ``[B, T]``
    float32 (0 off ``loss_mask``), from one forward under ``autocast_dtype``, as it samples."""
    from microrl.rollout.samplers.hf import autocast

    device = next(model.parameters()).device
    ids = probe["input_ids"].to(device)
    attention = probe["attention_mask"].to(device)
    positions = (attention.long().cumsum(1) - 1).clamp_min(0)
    was_training = model.training
    model.eval()
    try:
        with autocast(device, autocast_dtype):
            logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits
    finally:
        model.train(was_training)
    logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    taken = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.nn.functional.pad(taken, (1, 0))  # the first token: no log-prob
    return torch.where(probe["loss_mask"].to(device), out, 0.0).cpu()


def _build_model(spec: WorkerSpec) -> torch.nn.Module:
    """The trainer's architecture and LoRA structure, randomly initialised (the first push
    overwrites it) on ``spec.device`` in the base's storage dtype."""
    from microrl.engine.setup import apply_lora, auto_model_class
    from microrl.engine.vision import vision_spec

    config = spec.model_config  # plain attention: AsyncRollout sends it unwrapped_attention'd
    with torch.device(spec.device):  # on a GPU no host copy of the model ever exists
        model = auto_model_class(config).from_config(config, dtype=spec.base_dtype)
        tower = vision_spec(model) if spec.freeze_vision else None
        exclude = tower.tower_module_names(model) if tower is not None else None
        model, _ = apply_lora(model, spec.lora, exclude=exclude)
    return model.to(spec.device).eval()


def build_sampler(spec: WorkerSpec):
    """The worker's :class:`~microrl.rollout.HFRollout`, at the engine's precision."""
    from microrl.rollout.samplers.hf import HFRollout

    return HFRollout(
        _build_model(spec),
        spec.tokenizer,
        autocast_dtype=spec.autocast_dtype,
        image_encoder=spec.image_encoder,
        record_routing=spec.record_routing,
    )


class _Worker:
    def __init__(self, spec: WorkerSpec, commands, results) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        self.spec, self.commands, self.results = spec, commands, results
        device = torch.device(spec.device)
        if device.type == "cuda":
            # Its GPU explicitly: a spawned process's current device is GPU 0 on every rank.
            torch.cuda.set_device(device)
        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)
        self.sampler = build_sampler(spec)
        self.model = self.sampler.model
        self.env_maker = None
        if spec.env_maker is not None:
            try:
                self.env_maker = pickle.loads(spec.env_maker)
            except Exception as err:
                raise RuntimeError(
                    f"{spec.name} could not load the task's environment factory ({err!r}): a "
                    "multi-turn task sampled in a worker process needs a factory importable by "
                    "its module path"
                ) from err
        self.tensors = dict(self.model.named_parameters(remove_duplicate=False))
        self.tensors.update(self.model.named_buffers(remove_duplicate=False))
        self.layouts: dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]] = {}
        self.version: int | None = None
        results.put(("hello", os.getpid()))
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        self.group = ProcessGroupGloo(PrefixStore("microrl-rollout", store), 1, 2, timeout)

    def run(self) -> None:
        # ChannelClosed when the trainer is gone, at once
        while (command := self.commands.get())[0] != "close":
            kind, *args = command
            if kind == "layout":
                self._set_layouts(*args)
                self.results.put(("ready",))
            elif kind == "weights":
                self._receive(*args)
            elif kind in ("generate", "episodes"):
                self._job(kind, *args)
            else:
                raise ValueError(f"{self.spec.name}: unknown command {kind!r}")

    def _set_layouts(self, layouts: dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]]):
        problems = []
        for entries in layouts.values():
            for name, shape, dtype in entries:
                tensor = self.tensors.get(name)
                if tensor is None:
                    problems.append(f"{name} (missing here)")
                elif tuple(tensor.shape) != tuple(shape):
                    problems.append(f"{name} (shape {tuple(tensor.shape)} here, {shape} pushed)")
                elif tensor.dtype != dtype:
                    tensor.data = tensor.data.to(dtype)  # the trainer's storage dtype
        if problems:
            raise ValueError(
                f"{self.spec.name} built a model whose tensors differ from the trainer's: "
                + ", ".join(problems[:8])
            )
        self.layouts = layouts

    @torch.no_grad()
    def _receive(self, version: int, layout: str, chunk_bytes: int) -> None:
        """A push's chunks, each scattered into the tensors as it arrives (one on the host)."""
        start = time.perf_counter()
        entries = self.layouts[layout]
        receive_stream(
            self.tensors, entries, lambda chunk: self.group.broadcast(chunk, 0).wait(), chunk_bytes
        )
        self.version = version
        spec = self.spec
        probe = score_probe(self.model, spec.probe, spec.temperature, spec.autocast_dtype)
        sums = tensor_checksums((n, self.tensors[n]) for n, _, _ in entries)
        self.results.put(("synced", version, probe, sums, time.perf_counter() - start))

    def _job(self, kind: str, job: int, seed: int, args: tuple) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        torch.manual_seed(seed)
        try:
            if kind == "generate":
                prompts, params, images = args
                rollout = self.sampler.generate(prompts, params, images=images)
            else:
                problems, params, limits = args  # submit_episodes checked the env_maker
                images = (  # the problems' own images (they travel with the job)
                    [list(p.images) for p in problems]
                    if any(getattr(p, "images", ()) for p in problems)
                    else None
                )
                rollout = self.sampler.run_episodes(
                    [p.prompt for p in problems],
                    lambda i: self.env_maker(problems[i]),
                    params,
                    **limits,
                    images=images,
                )
            result = {**vars(rollout), "batch": dict(rollout.batch.items())}  # a plain batch
        except Exception as err:
            self.results.put(("job_error", job, _picklable(err)))
            return
        finally:
            if torch.device(self.spec.device).type == "cuda":
                torch.cuda.empty_cache()  # the KV cache of generate: back to the trainer's GPU
        seconds = (time.perf_counter() - start, time.process_time() - cpu)
        self.results.put(("done", job, self.version, result, seconds))


def _picklable(err: Exception) -> Exception:
    """The exception if it survives pickling, else a RuntimeError with its traceback."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        text = "".join(traceback.format_exception(err))
        return RuntimeError(f"{type(err).__name__}: {err}\n{text}")


def worker_main(spec: WorkerSpec, commands: Connection, results: Connection) -> None:
    """The spawned process's entry point, given its ends of the channels."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    for var in _LAUNCHER_VARS:
        os.environ.pop(var, None)
    inbox, outbox = Receiver(commands), Sender(results)
    try:
        _Worker(spec, inbox, outbox).run()
    except ChannelClosed:
        raise SystemExit(0) from None  # the trainer is gone: nobody reads what this makes
    except BaseException:
        with contextlib.suppress(ChannelClosed):
            outbox.put(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        outbox.close(timeout=spec.timeout_s)  # its last words, unless the trainer is gone
