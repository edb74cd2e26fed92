"""How the weights reach ``vllm serve`` servers: a LoRA adapter over HTTP, or the full weights
over vLLM's weight-transfer API (docs/async.md#weight-syncs)."""

from __future__ import annotations

import contextlib
import itertools
import math
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from microrl.engine.checkpoint.export import (
    export_merged_model,
    export_peft_adapter,
    locate_base_model,
)
from microrl.engine.parallel import distributed
from microrl.rollout.samplers import vllm_options
from microrl.rollout.samplers.vllm_http import ServerClient
from microrl.rollout.samplers.vllm_placement import (
    pushes_per_sync,
    trainer_address,
    transfer_backend,
)
from microrl.rollout.weights.full_weights import FullWeights
from microrl.rollout.weights.sync_check import engine_probe, engine_probe_logprobs
from microrl.rollout.weights.weight_sync import WeightSync

if TYPE_CHECKING:
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout

__all__ = ["WORKDIR_PREFIX", "HTTPAdapterSync", "ServerSyncJoiner", "TransferSync"]

#: The name of a run's work directory (its base model and adapters, which the servers read).
WORKDIR_PREFIX = "microrl-vllm-servers-"


class HTTPAdapterSync(WeightSync):
    """Path 4: the adapter exported (collective), loaded on every server in the background under
    a per-version name (vLLM 0.32 takes a path only); adapters no job uses are removed."""

    def __init__(self, owner: VLLMServerRollout) -> None:
        self.owner = owner
        self._loads: dict[int, Future] = {}  # version -> its load
        self._loaded: list[int] = []  # adapter versions loaded on the servers

    def push(self, engine, version: int) -> Future:
        owner = self.owner
        # After the previous load and this collective, no rank reads a directory rank 0 deletes.
        if (previous := self._loads.get(version - 1)) is not None:
            previous.result()
        path = self.join(engine, owner.workdir, version, owner._adapter_dtype)
        in_use = {job.version for job, _ in owner._futures.values()}
        load = lambda: self._load(version, path, in_use)  # noqa: E731
        loaded = self._loads[version] = owner._sync_thread.submit(owner._timed, load)
        self._loads.pop(version - 2, None)
        return loaded

    @staticmethod
    def join(engine, workdir: Path, version: int, dtype: torch.dtype | None = None) -> Path:
        """The push's collective: the adapter's export (``dtype`` None: as trained)."""
        path = workdir / f"adapter-{version}"
        return export_peft_adapter(engine.module, path, peft_model=engine.peft_model, dtype=dtype)

    def _load(self, version: int, path: Path, in_use: set[int]) -> None:
        owner = self.owner
        for client in owner.clients:
            client.post(
                "v1/load_lora_adapter",
                {"lora_name": owner._adapter(version), "lora_path": str(path)},
            )
        stale = [v for v in self._loaded if v not in in_use]
        self._loaded = [v for v in self._loaded if v in in_use] + [version]
        for old in stale:
            for client in owner.clients:
                client.post("v1/unload_lora_adapter", {"lora_name": owner._adapter(old)})
            if distributed.rank() == 0:  # every rank loaded it (see push)
                shutil.rmtree(owner.workdir / f"adapter-{old}", ignore_errors=True)

    def close(self) -> None:
        """Servers the user started outlive this trainer: our adapters are taken back."""
        owner = self.owner
        if not owner._servers:
            for client, version in itertools.product(owner.clients, self._loaded):
                with contextlib.suppress(Exception):
                    client.post("v1/unload_lora_adapter", {"lora_name": owner._adapter(version)})
        self._loaded = []


class TransferSync(WeightSync):
    """Path 5: full weights through a ``WeightPusher`` per server, one tensor at a time;
    requests in flight pause for a push and resume on the new weights."""

    def __init__(self, owner: VLLMServerRollout) -> None:
        from microrl.rollout.weights.pusher import WeightPusher

        self.owner = owner
        self.pushers: list[WeightPusher] = []
        self._first = True
        engine, config = owner.engine, owner.config
        backend = transfer_backend(engine.device, owner._server_gpus)
        try:
            for client in owner.clients:
                workers = config.tensor_parallel_size if owner._servers else _workers(client)
                pusher = WeightPusher(
                    backend,
                    client.post,
                    world_size=1 + workers,
                    master_address=trainer_address(client.url, config.trainer_address),
                    timeout_s=owner.timeout_s,
                )
                self.pushers.append(pusher)
                with _on_gpu(engine.device):
                    pusher.start()
        except BaseException:
            self.close()
            raise

    def push(self, engine, version: int) -> None:
        """Push ``engine``'s weights to every server (CPU tensors for gloo)."""
        owner, pause, self._first = self.owner, not self._first, False
        on_gpu = self.pushers and self.pushers[0].backend != "gloo"
        weights = FullWeights(
            engine.module, owner._prefix, device=None if on_gpu else "cpu", dtype=owner._push_dtype
        )
        for client, pusher in zip(owner.clients, self.pushers, strict=True):
            if pause:  # in flight: running requests freeze, then continue on the new weights
                client.post("pause", mode="keep")
            try:
                with _on_gpu(engine.device):
                    pusher.push(weights, version)
            finally:
                if pause:
                    client.post("resume")
        # A rank with fewer servers (rollout.server.url) still joins the others' gathers.
        self.join(engine, owner._prefix, owner._pushes_per_sync - len(self.pushers))

    @staticmethod
    def join(engine, prefix: str, passes: int) -> None:
        """The gathers of ``passes`` pushes."""
        for _ in range(passes):
            for _ in FullWeights(engine.module, prefix):
                pass

    def close(self) -> None:
        for pusher in self.pushers:
            with contextlib.suppress(Exception):
                pusher.close()
        self.pushers = []


class ServerSyncJoiner:
    """A ``VLLMServerRollout``'s collectives on the rest of its sp group, once per sync. It
    mirrors ``__init__`` and ``_submit_sync``: change both
    (tests/examples/test_examples_sequence_parallel_servers.py runs both)."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        version: int,
        urls: list[str],
        num_workers: int,
        workdir: str | None = None,
    ) -> None:
        self.probe = engine_probe(engine, tokenizer)
        self.prefix = locate_base_model(engine.module)[0]
        self.workdir = vllm_options.make_workdir(workdir, WORKDIR_PREFIX)[0]
        self.passes = pushes_per_sync(engine, urls, num_workers)
        if not urls:
            export_merged_model(engine.module, self.workdir / "base", merge_lora=False)
        self.version = int(version)
        self._join(engine)  # the start's push, version ``version``

    def __call__(self, engine) -> None:
        """Join the push of the next version."""
        self.version += 1
        self._join(engine)

    def _join(self, engine) -> None:
        engine_probe_logprobs(engine, self.probe)  # ProbeVerifier.expected
        if engine.peft_model is not None:
            HTTPAdapterSync.join(engine, self.workdir, self.version)
        else:
            TransferSync.join(engine, self.prefix, self.passes)


def _on_gpu(device: torch.device):
    """The engine's GPU made current (vLLM's trainer engines use the current one)."""
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _workers(client: ServerClient) -> int:
    """The workers (TP x PP x DP) of a server the user started, from its ``/server_info``."""
    info = client.get("server_info?config_format=json")
    try:
        parallel = info["vllm_config"]["parallel_config"]
        return math.prod(
            int(parallel.get(f"{key}_parallel_size", 1)) for key in ("tensor", "pipeline", "data")
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"the vLLM server at {client.url} answered /server_info without its parallel "
            f"sizes ({type(err).__name__}: {err})"
        ) from err
