"""The one place a run's out-of-process sampler is chosen from its rollout config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from microrl.configs.run import RolloutConfig
from microrl.remote.trainer.protocol import AsyncSampler, SamplerOptions

__all__ = ["make_async_sampler"]


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
    servers of ``rollout.server.url`` (key: in the variable ``rollout.server.api_key_env`` names),
    environments stepped in this process; ``log_dir`` keeps the local servers' logs;
    ``image_encoder``: a vision-language policy's, so jobs may carry images. Under
    sequence parallelism (``engine.sp_group``) either is one per sp group, on its first process
    (:class:`~microrl.remote.trainer.sp_group.SPGroupSampler`): the servers of
    ``rollout.server.url`` split by data rank, local ones started per data rank.
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
        from microrl.remote.trainer.server_weight_syncs import ServerSyncJoiner
        from microrl.remote.trainer.vllm_servers import VLLMServerRollout, check_arguments

        urls = rollout.server.urls
        workers = rollout.num_workers
        check_arguments(engine, rollout.vllm, urls, workers)  # on every process

        def start() -> AsyncSampler:
            return VLLMServerRollout(
                engine,
                tokenizer,
                rollout.vllm,
                options,
                urls=urls,
                api_key=rollout.server.api_key(),
                num_workers=workers,
                log_dir=log_dir,
            )

        def join() -> Callable[[Any], None]:
            return ServerSyncJoiner(
                engine, tokenizer, version=version, urls=urls, num_workers=workers
            )
    else:
        from microrl.remote.trainer.hf_pool import make_async_rollout
        from microrl.remote.trainer.sp_group import HFPushJoiner

        def start() -> AsyncSampler:
            return make_async_rollout(engine, tokenizer, options, num_workers=rollout.num_workers)

        def join() -> Callable[[Any], None]:
            return HFPushJoiner(engine, tokenizer, num_workers=rollout.num_workers)

    if getattr(engine, "sp_group", None) is None:
        return start()
    from microrl.remote.trainer.sp_group import SPGroupSampler

    return SPGroupSampler.start(engine, start, join, version=version, env_maker=env_maker)
