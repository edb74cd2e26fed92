"""The one place a run's out-of-process sampler is chosen from its rollout config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from microrl.configs.run import RolloutConfig
from microrl.remote.trainer.protocol import AsyncSampler

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
) -> AsyncSampler:
    """The sampler of ``rollout.backend`` holding ``engine``'s weights as ``version``.

    ``hf``: ``rollout.num_workers`` worker processes (one :class:`AsyncRollout`, or an
    :class:`AsyncRolloutPool`), environments built in the workers. ``vllm``: a
    :class:`VLLMServerRollout` on ``rollout.num_workers`` local ``vllm serve`` processes or the
    servers of ``rollout.server_url`` (key: ``rollout.server_api_key`` or ``VLLM_API_KEY``),
    environments stepped in this process; ``log_dir`` keeps the local servers' logs. Under
    sequence parallelism (``engine.sp_group``) the ``hf`` workers are one set per sp group
    (:class:`~microrl.remote.trainer.sp_group.SPGroupSampler`); vLLM servers are not shared by
    a group yet (``ValueError``).
    """
    if not isinstance(rollout, RolloutConfig):
        raise TypeError(f"rollout must be a RolloutConfig, got {type(rollout).__name__}")
    common = dict(
        version=version,
        env_maker=env_maker,
        timeout_s=rollout.worker_timeout_s,
        sync_check_tol=rollout.sync_check_tol,
        num_threads=num_threads,
    )
    sp_group = getattr(engine, "sp_group", None)
    if rollout.backend == "vllm" and sp_group is not None:
        raise ValueError(
            "actor.sequence_parallel_size > 1 with rollout.max_staleness > 0 needs "
            "rollout.backend=hf (one hf worker per sequence-parallel group; vLLM servers are not "
            "shared by a group yet)"
        )
    if rollout.backend == "vllm":
        from microrl.remote.trainer.vllm_servers import VLLMServerRollout

        urls = [u.strip() for u in rollout.server_url.split(",") if u.strip()]
        api_key = rollout.server_api_key or None
        return VLLMServerRollout(
            engine,
            tokenizer,
            rollout.vllm,
            urls=urls,
            api_key=api_key,
            num_workers=rollout.num_workers,
            log_dir=log_dir,
            **common,
        )
    if rollout.backend != "hf":
        raise ValueError(f"rollout.backend must be 'hf' or 'vllm', got {rollout.backend!r}")
    from microrl.remote.trainer.hf_pool import make_async_rollout

    def start() -> AsyncSampler:
        return make_async_rollout(engine, tokenizer, num_workers=rollout.num_workers, **common)

    if sp_group is None:
        return start()
    from microrl.remote.trainer.sp_group import SPGroupSampler

    return SPGroupSampler.start(
        engine,
        tokenizer,
        start,
        version=version,
        num_workers=rollout.num_workers,
        env_maker=env_maker,
    )
