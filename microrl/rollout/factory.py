"""Pick a sampler from the rollout config: a backend by name (``rollout.backend``), or the
out-of-process sampler of asynchronous RL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from microrl.configs.rollout import ROLLOUT_BACKENDS, VLLMConfig
from microrl.configs.run import RolloutConfig
from microrl.rollout.base import RolloutBackend
from microrl.rollout.images import ImageEncoder
from microrl.rollout.sampler import AsyncSampler, SamplerOptions
from microrl.rollout.samplers.hf import HFRollout

__all__ = ["make_async_sampler", "make_rollout_backend"]


def make_rollout_backend(
    backend: str,
    engine,
    tokenizer,
    *,
    vllm: VLLMConfig | None = None,
    sync_check_tol: float | None = None,
    image_encoder: ImageEncoder | None = None,
) -> RolloutBackend:
    """The ``backend`` (``"hf"`` or ``"vllm"``) sampling from ``engine``'s policy.

    ``vllm`` configures the ``vllm`` backend (defaults when omitted); the ``hf`` backend needs
    nothing; ``sync_check_tol`` bounds the check of each ``vllm`` sync (None: by the engine's
    precision). A ``vllm`` backend without vLLM installed raises ``ImportError`` with the command
    that installs it. ``image_encoder``: a vision-language policy's (image prompts; the ``vllm``
    backend refuses it where vLLM's Qwen-VL code cannot load, docs/rollouts.md#images).
    """
    if backend == "hf":
        return HFRollout(engine, tokenizer, image_encoder=image_encoder)
    if backend == "vllm":
        from microrl.rollout.samplers.vllm import VLLMRollout

        return VLLMRollout(
            engine,
            tokenizer,
            vllm or VLLMConfig(),
            sync_check_tol=sync_check_tol,
            image_encoder=image_encoder,
        )
    raise ValueError(
        f"rollout.backend must be one of {', '.join(ROLLOUT_BACKENDS)}, got {backend!r}"
    )


def make_async_sampler(
    engine,
    tokenizer,
    rollout: RolloutConfig,
    *,
    version: int,
    env_maker: Callable[[Any], Any] | None = None,
    num_threads: int = 1,
    log_dir: str | None = None,
    image_encoder: Any = None,
) -> AsyncSampler:
    """The sampler of ``rollout.backend`` holding ``engine``'s weights as ``version``.

    ``hf``: ``rollout.num_workers`` worker processes (one :class:`AsyncRollout`, or an
    :class:`AsyncRolloutPool`), environments built in the workers. ``vllm``: a
    :class:`VLLMServerRollout` on ``rollout.num_workers`` local ``vllm serve`` processes or the
    servers of ``rollout.server_url`` (key: ``rollout.server_api_key`` or ``VLLM_API_KEY``),
    environments stepped in this process; ``log_dir`` keeps the local servers' logs;
    ``image_encoder``: a vision-language policy's, so jobs may carry images. Under
    sequence parallelism (``engine.sp_group``) either is one per sp group, on its first process
    (:class:`~microrl.rollout.samplers.sp_group.SPGroupSampler`): the servers of
    ``rollout.server_url`` split by data rank, local ones started per data rank.
    """
    if not isinstance(rollout, RolloutConfig):
        raise TypeError(f"rollout must be a RolloutConfig, got {type(rollout).__name__}")
    if rollout.backend not in ("hf", "vllm"):
        raise ValueError(f"rollout.backend must be 'hf' or 'vllm', got {rollout.backend!r}")
    options = SamplerOptions(
        version=version,
        env_maker=env_maker,
        timeout_s=rollout.worker_timeout_s,
        sync_check_tol=rollout.sync_check_tol,
        num_threads=num_threads,
        image_encoder=image_encoder,
    )
    if rollout.backend == "vllm":
        from microrl.rollout.samplers.vllm_servers import VLLMServerRollout, check_arguments
        from microrl.rollout.weights.server_syncs import ServerSyncJoiner

        urls = [u.strip() for u in rollout.server_url.split(",") if u.strip()]
        workers = rollout.num_workers
        check_arguments(engine, rollout.vllm, urls, workers)  # on every process

        def start() -> AsyncSampler:
            return VLLMServerRollout(
                engine,
                tokenizer,
                rollout.vllm,
                options,
                urls=urls,
                api_key=rollout.server_api_key or None,
                num_workers=workers,
                log_dir=log_dir,
            )

        def join() -> Callable[[Any], None]:
            return ServerSyncJoiner(
                engine, tokenizer, version=version, urls=urls, num_workers=workers
            )
    else:
        from microrl.rollout.samplers.hf_pool import make_async_rollout
        from microrl.rollout.samplers.sp_group import HFPushJoiner

        def start() -> AsyncSampler:
            return make_async_rollout(engine, tokenizer, options, num_workers=rollout.num_workers)

        def join() -> Callable[[Any], None]:
            return HFPushJoiner(engine, tokenizer, num_workers=rollout.num_workers)

    if getattr(engine, "sp_group", None) is None:
        return start()
    from microrl.rollout.samplers.sp_group import SPGroupSampler

    return SPGroupSampler.start(engine, start, join, version=version, env_maker=env_maker)
