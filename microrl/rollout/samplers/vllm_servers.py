"""Asynchronous ``vllm`` rollouts: ``vllm serve`` processes (ours or ``urls``) sample while the
trainer trains. A LoRA version is an adapter the requests name (exact per row); full weights
update in flight (rows keep first and last tokens' versions). docs/async.md#vllm-servers."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from microrl.configs.refusals import check_vllm_servers
from microrl.configs.rollout import VLLMConfig
from microrl.engine.base import Engine
from microrl.engine.checkpoint.export import locate_base_model
from microrl.engine.parallel import distributed
from microrl.rollout.base import Images, Prompts, Rollout, RolloutBackend, Samples, SamplingParams
from microrl.rollout.images import ImagePrompts, problem_images
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, WorkerError, WorkerSampler
from microrl.rollout.samplers import vllm_images, vllm_options, vllm_placement, vllm_requests
from microrl.rollout.samplers.vllm_http import ServerClient, exit_status
from microrl.rollout.samplers.vllm_placement import cuda_visible_devices, data_rank
from microrl.rollout.samplers.vllm_requests import GENERATE_ROUTE, ServerPrompt, probe_body
from microrl.rollout.weights.server_syncs import WORKDIR_PREFIX, HTTPAdapterSync, TransferSync
from microrl.rollout.weights.weight_sync import ProbeVerifier, WeightSync, pushed_weights

if TYPE_CHECKING:  # annotations only
    from microrl.rollout.sampler import SamplerOptions

__all__ = ["POLICY_VERSION_LAST_KEY", "VLLMServerRollout", "check_arguments"]

#: The per-row ``[B]`` int64 batch key: the policy version of a row's last sampled token.
POLICY_VERSION_LAST_KEY = "policy_version_last"
# Concurrent HTTP requests per server: enough to fill vLLM's continuous batch.
_REQUESTS_PER_SERVER = 64


class VLLMServerRollout(WorkerSampler):
    """vLLM servers sampling for the trainer: submit jobs now, collect their rollouts later.

    Args:
        engine: the :class:`~microrl.engine.ActorEngine` sampled (its weights: ``version``).
        tokenizer: its tokenizer.
        config: :class:`~microrl.configs.rollout.VLLMConfig` of the servers this class starts.
        options: :class:`~microrl.rollout.sampler.SamplerOptions` (None: the defaults).
        urls: servers the user started (``rollout.server.url``), every ``w``-th one per data
            rank. Empty: start ``num_workers`` (per data rank).
        api_key: their ``--api-key`` (None: ``$VLLM_API_KEY``).
        num_workers: local servers to start (without ``urls``).
        workdir: where the base model and adapters go (the servers must see it).
        log_dir: where local servers' logs are kept; None: temporary, kept only on failure.
    """

    name = "the vLLM server rollout"

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        config: VLLMConfig | None = None,
        options: SamplerOptions | None = None,
        *,
        urls: Sequence[str] = (),
        api_key: str | None = None,
        num_workers: int = 1,
        workdir: str | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.config = config or VLLMConfig()
        check_arguments(engine, self.config, urls, num_workers)
        options = self._start(engine, tokenizer, options)
        if self.image_encoder is not None:
            sampler = "rollout.backend=vllm (its servers under rollout.max_staleness > 0)"
            vllm_images.check_vision(tokenizer, sampler)
            # The servers cache image embeddings across pushes: a trained tower makes them stale.
            if not getattr(engine.config, "freeze_vision", True):
                raise ValueError(
                    "actor.freeze_vision=False with images on vLLM servers: the servers cache "
                    "image embeddings across weight pushes, which a trained vision tower makes "
                    "stale; keep the tower frozen or use rollout.backend=hf"
                )
        #: The layout, episodes and decoding of every backend, sampling through these servers.
        self.backend = _ServerBackend(
            self, getattr(getattr(engine, "model", None), "generation_config", None)
        )
        self.log_dir = log_dir
        self.is_lora = engine.peft_model is not None
        self._prefix, base = locate_base_model(engine.module)
        self.workdir, self._own_workdir = vllm_options.make_workdir(workdir, WORKDIR_PREFIX)
        self._run_id = secrets.token_hex(4)
        self._futures: dict[int, tuple[Job, Future]] = {}
        self._syncs: dict[int, Future] = {}  # version -> its check (after its load)
        self._context = threading.local()
        self._servers = []
        self.weight_sync: WeightSync | None = None
        self._server_gpus: list[list[int]] | None = None  # cuda:N of each local server
        # The push dtypes: the local servers' (vLLM casts on load); None for users' servers.
        self._push_dtype: torch.dtype | None = None
        self._adapter_dtype: torch.dtype | None = None
        # The most servers any rank pushes to.
        self._pushes_per_sync = vllm_placement.pushes_per_sync(engine, urls, num_workers)
        self._job_thread = ThreadPoolExecutor(1, thread_name_prefix="microrl-vllm-job")
        self._sync_thread = ThreadPoolExecutor(1, thread_name_prefix="microrl-vllm-sync")
        try:
            self.clients = self._connect(base, urls, api_key, num_workers, options.num_threads)
            self._requests = ThreadPoolExecutor(
                _REQUESTS_PER_SERVER * len(self.clients), thread_name_prefix="microrl-vllm-req"
            )
            #: How each sync reaches the servers: an adapter over HTTP, or full weights.
            self.weight_sync = HTTPAdapterSync(self) if self.is_lora else TransferSync(self)
            self._submit_sync(engine, self.version).result()
        except BaseException:
            self.close()
            raise

    def _connect(self, base, urls, api_key, num_workers, num_threads) -> list[ServerClient]:
        rank, world = data_rank(self.engine)  # servers belong to a data rank (an sp group's)
        if urls:
            mine = vllm_placement.urls_of_data_rank(urls, rank, world)
            clients = [ServerClient(url, api_key, timeout_s=self.timeout_s) for url in mine]
            for client in clients:
                client.get("v1/models")  # reachable, and the key is accepted: fail at start
            return clients
        from microrl.rollout.samplers.vllm_launch import LocalVLLMServer

        cfg = self.config
        # Without CUDA_VISIBLE_DEVICES every server of every rank would start on the first GPU.
        gpus = self._server_gpus = vllm_placement.server_gpus(
            self.engine.device,
            num_workers=num_workers,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpus=cfg.gpus,
            group_size=distributed.world_size() // world,
        )
        model_dir = vllm_options.export_base(
            self.engine, self.workdir, self.tokenizer, self.image_encoder
        )
        device = self.engine.device
        cpu_owned = vllm_options.CPU_OWNED if device.type == "cpu" else {}
        owned = {**vllm_options.OWNED, **vllm_options.SERVER_OWNED, **cpu_owned}
        if not self.is_lora:  # a cached block computed with old weights must not serve new ones
            owned["enable_prefix_caching"] = "full-weight pushes need prefix caching off"
        dtype = vllm_options.resolve_dtype(cfg.dtype, self.engine, base)
        self._push_dtype = getattr(torch, dtype)
        self._adapter_dtype = vllm_options.adapter_dtype(dtype, cfg.engine_kwargs)
        lora_rank = self.engine.config.lora.rank
        options = dict(
            vllm_options.config_options(cfg, device),
            dtype=dtype,
            lora_rank=vllm_options.max_lora_rank(lora_rank) if self.is_lora else 0,
            max_loras=4,
            weight_transfer=None if self.is_lora else vllm_placement.transfer_backend(device, gpus),
            tensor_parallel_size=cfg.tensor_parallel_size,
            engine_args=vllm_options.user_engine_args(cfg.engine_kwargs, owned=owned),
            images=self.image_encoder is not None,
        )

        def start(i: int) -> LocalVLLMServer:
            return LocalVLLMServer(
                str(model_dir),
                full_weights=not self.is_lora,
                num_threads=num_threads,
                timeout_s=self.timeout_s,
                name=f"local vLLM server {i} of rank {rank}",
                log_dir=self.log_dir,
                seed=vllm_options.engine_seed(cfg.seed, rank=rank, index=i, per_rank=num_workers),
                cuda_visible_devices=None if gpus is None else cuda_visible_devices(gpus[i]),
                **options,
            )

        # Side by side (~20 s each on a CPU); one after the other where they share a GPU, whose
        # free memory each vLLM measures as it starts.
        shared = gpus is not None and len({tuple(g) for g in gpus}) < len(gpus)
        with ThreadPoolExecutor(1 if shared else num_workers) as pool:
            futures = [pool.submit(start, i) for i in range(num_workers)]
            for future in futures:
                with contextlib.suppress(Exception):
                    self._servers.append(future.result())
            for future in futures:
                future.result()  # the first failure, after every server is kept for close()
        return [server.client for server in self._servers]

    def _close(self) -> None:
        """Stop the local servers, release the transfer groups, remove the work directory."""
        for pool in (self._job_thread, self._sync_thread, getattr(self, "_requests", None)):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if self.weight_sync is not None:
            self.weight_sync.close()
        for server in self._servers:
            server.close()
        vllm_options.remove_workdir(self.workdir, owned=self._own_workdir)

    def _push(self, engine, version: int) -> None:
        """Returns once the weights are taken (collective); load and check run in the background."""
        self.poll()
        self.version = version
        self._submit_sync(engine, version)

    def _submit_sync(self, engine, version: int) -> Future:
        expected = ProbeVerifier.of(self).expected(engine)
        if self.is_lora:  # the export on this thread, the load in the background
            loaded = self.weight_sync.push(engine, version)
        else:
            # Streamed (collective) before the optimizer steps, after the previous check.
            previous = self._syncs.get(version - 1)
            if previous is not None:
                previous.result()
            self._timed(lambda: self.weight_sync.push(engine, version))
            loaded = Future()
            loaded.set_result(None)
        # LoRA: checked between jobs, alone (vLLM 0.32's CPU LoRA logits fail a batch mixing
        # prompt log-probs with other requests); full weights: at once, before the next push.
        thread = self._job_thread if self.is_lora else self._sync_thread
        future = thread.submit(self._check, version, loaded, expected)
        self._syncs[version] = future
        return future

    def _timed(self, load: Callable[[], None]) -> None:
        start = time.perf_counter()
        load()
        self.sync_seconds.append(time.perf_counter() - start)

    def _check(self, version: int, loaded: Future, expected: torch.Tensor) -> None:
        loaded.result()
        verifier = ProbeVerifier.of(self)
        detail = f"pushed: {pushed_weights(self.is_lora)}"
        for i, client in enumerate(self.clients):
            target = f"the vLLM server at {client.url} (server {i})"
            verifier.verify(version, target, expected, self._score_probe(client, version), detail)

    def _score_probe(self, client: ServerClient, version: int) -> torch.Tensor:
        """The server's probe log-probs at temperature 1, ``[B, T]`` like the engine's."""
        adapter = self._adapter(version)
        verifier = ProbeVerifier.of(self)
        scored = [
            vllm_requests.prompt_logprobs(client.post(GENERATE_ROUTE, probe_body(r, adapter)), r)
            for r in verifier.rows()
        ]
        return verifier.layout(scored)

    def _submit(
        self, run: Callable[[], Any], kind: str, params: SamplingParams, seed: int | None = None
    ) -> Job:
        job, seed = self._new_job(kind, params, seed)
        waits_for = self._syncs.get(job.version)
        future = self._job_thread.submit(self._run_job, job, seed, waits_for, run)
        self._futures[job.id] = (job, future)
        return job

    def _run_job(self, job: Job, seed: int, waits_for: Future | None, run) -> Rollout:
        if waits_for is not None:
            waits_for.result()  # the job's version is loaded (and checked) first
        start = time.perf_counter()
        self._context.job, self._context.seed, self._context.versions = job, seed, []
        try:
            rollout = run()
        finally:
            self._context.job = None
        rows = rollout.batch.batch_size[0]
        spans = self._context.versions or [job.version, job.version]
        versions = torch.tensor(spans, dtype=torch.long).reshape(-1, 2)
        if len(versions) != rows:  # episodes: each row spans the job's
            versions = torch.stack([versions[:, 0].min(), versions[:, 1].max()]).repeat(rows, 1)
        rollout.batch[POLICY_VERSION_KEY] = versions[:, 0].reshape(-1)
        rollout.batch[POLICY_VERSION_LAST_KEY] = versions[:, 1].reshape(-1)
        self.job_seconds.append(time.perf_counter() - start)
        return rollout

    def submit(self, prompts: Prompts, params: SamplingParams, *, images: Images = None) -> Job:
        """``images`` go to the servers as lossless PNGs; the prompt each server ran is
        checked against the encoder's (docs/rollouts.md#images)."""
        prompts, images = self._job_prompts(prompts, images)
        run = lambda: self.backend.generate(prompts, params, images=images)  # noqa: E731
        return self._submit(run, "generate", params)

    def _submit_episodes(self, problems, params, limits, seed) -> Job:
        """The environments step in this process while the servers sample."""
        maker = self.env_maker
        images = problem_images(problems) if self.image_encoder is not None else None
        run = lambda: self.backend.run_episodes(  # noqa: E731
            [p.prompt for p in problems],
            lambda i: maker(problems[i]),
            params,
            **limits,
            images=images,
        )
        return self._submit(run, "episodes", params, seed)

    def collect(self, job: Job) -> Rollout:
        """Waits at most ``timeout_s`` while no server has died; the batch carries
        ``policy_version_last`` too."""
        self._check_open()
        if job.id not in self._futures:
            raise ValueError(f"job {job.id} was not submitted here or was collected already")
        _, future = self._futures[job.id]
        deadline = time.monotonic() + self.timeout_s
        what = f"the rollout of job {job.id} (policy version {job.version})"
        while not future.done():
            for server in self._servers:
                if not server.alive():
                    raise WorkerError(
                        f"{server.name} died ({exit_status(server.process.returncode)}) while "
                        f"the trainer waited for {what}; {server.diagnosis()}"
                    )
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"the vLLM servers did not finish job {job.id} within {self.timeout_s:.0f} s "
                    "(rollout.worker_timeout_s)"
                )
            with contextlib.suppress(TimeoutError):
                future.result(timeout=0.5)
        del self._futures[job.id]
        return future.result()

    def poll(self) -> None:
        self._check_open()
        for version, future in list(self._syncs.items()):
            if future.done():
                future.result()
                if version < self.version:
                    del self._syncs[version]

    def sample_in_job(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        images: ImagePrompts | None = None,
    ) -> Samples:
        """The servers' samples of ``prompt_ids`` for this thread's job (the backend's sampler)."""
        job, seed = getattr(self._context, "job", None), getattr(self._context, "seed", None)
        if job is None:
            raise RuntimeError("VLLMServerRollout samples inside a job: use submit and collect")
        copies = vllm_options.requests_per_prompt(params)  # greedy: one request per copy
        prompts = [
            vllm_requests.server_prompt(ids, images, p, self.image_encoder)
            for p, ids in enumerate(prompt_ids)
        ]
        requests = [prompt for prompt in prompts for _ in range(copies)]
        self._context.seed = seed + len(requests)  # the next call of an episode: fresh seeds
        futures = [
            self._requests.submit(self._request, i, prompt, params, seed + i, job.version)
            for i, prompt in enumerate(requests)
        ]
        token_ids, logprobs = [], []
        for future in futures:
            for ids, lps, versions in future.result():
                token_ids.append(ids)
                logprobs.append(lps)
                self._context.versions.extend(versions)
        return Samples(token_ids=token_ids, logprobs=logprobs)

    def _request(
        self, i: int, prompt: ServerPrompt, params: SamplingParams, seed: int, version: int
    ):
        client = self.clients[i % len(self.clients)]
        body = vllm_requests.generate_body(
            prompt.ids,
            params,
            seed=seed,
            eos_token_id=self.backend.stop_token_ids,
            adapter=self._adapter(version),
            images=prompt.images,
        )
        response = client.post(GENERATE_ROUTE, body)
        prompt.check(response)
        # LoRA: every token comes from the request's adapter; full weights: from the spans.
        version = version if self.is_lora else None
        return vllm_requests.parse_samples(response, url=client.url, version=version)

    def _adapter(self, version: int) -> str | None:
        """A version's adapter name, unique to this run and rank: sharers never collide (None:
        full weights, the served ones)."""
        return f"microrl-{self._run_id}-r{distributed.rank()}-v{version}" if self.is_lora else None


class _ServerBackend(RolloutBackend):
    """A rollout backend whose samples come from a :class:`VLLMServerRollout`'s servers."""

    def __init__(self, owner: VLLMServerRollout, generation_config=None) -> None:
        super().__init__(
            owner.tokenizer,
            generation_config=generation_config,
            image_encoder=getattr(owner, "image_encoder", None),
        )
        self.owner = owner

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        return self.owner.sample_in_job(prompt_ids, params)

    def _sample_images(self, prompts: ImagePrompts, params: SamplingParams) -> Samples:
        return self.owner.sample_in_job(prompts.ids, params, prompts)


def check_arguments(engine, config: VLLMConfig, urls: Sequence[str], num_workers: int) -> None:
    """Check :class:`VLLMServerRollout`'s arguments before anything starts (on every process of
    an sp group: none waits in a collective for one that refused)."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a microrl engine, got {type(engine).__name__}")
    if not isinstance(config, VLLMConfig):
        raise TypeError(f"config must be a VLLMConfig, got {type(config).__name__}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    check_vllm_servers(config, urls)  # the rollout rows of microrl.configs.refusals
    if urls:
        vllm_placement.urls_of_data_rank(urls, *data_rank(engine))
