"""The one place a sampler is picked: :func:`make_sampler` from a run's rollout config (and
:func:`make_rollout_backend`, a backend by name, docs/api.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from microrl.configs.rollout import ROLLOUT_BACKENDS, VLLMConfig
from microrl.configs.run import RolloutConfig
from microrl.rollout.base import RolloutBackend
from microrl.rollout.images import ImageEncoder
from microrl.rollout.sampler import Sampler, SamplerOptions
from microrl.rollout.samplers.hf import HFRollout, routing_recorder
from microrl.rollout.samplers.in_process import InProcessSampler

__all__ = ["check_records_routing", "make_rollout_backend", "make_sampler"]


def make_rollout_backend(
    backend: str,
    engine,
    tokenizer,
    *,
    vllm: VLLMConfig | None = None,
    sync_check_tol: float | None = None,
    image_encoder: ImageEncoder | None = None,
    record_routing: bool = False,
) -> RolloutBackend:
    """The ``backend`` (``"hf"`` or ``"vllm"``) sampling from ``engine``'s policy; ``vllm``: its
    config (None: defaults); ``sync_check_tol``: each ``vllm`` sync's bound (None: by the
    engine's precision); ``record_routing``: ``rollout.routing_replay`` (``hf`` only)."""
    if backend == "hf":
        return HFRollout(
            engine, tokenizer, image_encoder=image_encoder, record_routing=record_routing
        )
    if record_routing:
        check_records_routing(engine, backend)
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


def make_sampler(
    engine,
    tokenizer,
    rollout: RolloutConfig,
    *,
    version: int,
    env_maker: Callable[[Any], Any] | None = None,
    num_threads: int = 1,
    log_dir: str | None = None,
    image_encoder: ImageEncoder | None = None,
) -> Sampler:
    """The sampler of ``rollout`` holding ``engine``'s weights as ``version`` (a recipe: its step).

    ``k = 0``: ``rollout.backend`` in this process; ``k > 0``: ``hf`` workers or ``vllm serve``
    servers (logs in ``log_dir``, ``num_threads`` CPU threads each), one per sp group
    (docs/async.md). ``env_maker``: a multi-turn task's ``problem -> environment``.
    """
    if not isinstance(rollout, RolloutConfig):
        raise TypeError(f"rollout must be a RolloutConfig, got {type(rollout).__name__}")
    if rollout.routing_replay:
        check_records_routing(engine, rollout.backend)
    if rollout.backend == "vllm":
        check_vllm_takes_the_experts(engine)
    if rollout.max_staleness == 0:
        backend = make_rollout_backend(
            rollout.backend,
            engine,
            tokenizer,
            vllm=rollout.vllm,
            sync_check_tol=rollout.sync_check_tol,
            image_encoder=image_encoder,
            record_routing=rollout.routing_replay,
        )
        return InProcessSampler(
            backend, engine, version=version, sync_every=rollout.sync_every, env_maker=env_maker
        )
    options = SamplerOptions(
        version=version,
        env_maker=env_maker,
        timeout_s=rollout.worker_timeout_s,
        sync_check_tol=rollout.sync_check_tol,
        num_threads=num_threads,
        image_encoder=image_encoder,
        record_routing=rollout.routing_replay,
    )
    if rollout.backend == "vllm":
        start, join = _servers(engine, tokenizer, rollout, options, log_dir)
    else:  # "hf": RolloutConfig checked the name
        start, join = _workers(engine, tokenizer, rollout, options)
    if getattr(engine, "sp_group", None) is None:
        return start()
    from microrl.rollout.samplers.sp_group import SPGroupSampler

    return SPGroupSampler.start(engine, start, join, version=version, env_maker=env_maker)


def check_records_routing(engine, backend: str) -> None:
    """``rollout.routing_replay=true``: ``ValueError`` unless ``hf`` and a policy with routers."""
    if backend != "hf":
        raise ValueError(
            f"rollout.routing_replay=true: rollout.backend={backend} does not record the routing "
            "(only rollout.backend=hf does)"
        )
    routing_recorder(getattr(engine, "model", engine))


def check_vllm_takes_the_experts(engine) -> None:
    """``rollout.backend=vllm`` at start: ``ValueError`` when the pushes would carry a mixture of
    experts' fused 3-D expert tensors, which vLLM's loader does not map."""
    from microrl.engine.moe.routers import find_routers

    model = getattr(engine, "model", engine)
    if not isinstance(model, torch.nn.Module) or not find_routers(model):
        return
    lora = getattr(getattr(engine, "config", None), "lora", None)
    if lora is not None and lora.rank > 0 and not lora.target_parameters:
        return
    pushed = "the full weights" if lora is None or lora.rank == 0 else "adapters on the experts"
    raise ValueError(
        f"rollout.backend=vllm with a mixture-of-experts policy whose pushes carry {pushed}: "
        "microrl sends transformers' fused expert tensors, which vLLM's loader does not map yet "
        "(the sync probe fails at the first push); use rollout.backend=hf, or LoRA on the "
        "attention alone (lora.target_parameters empty)"
    )


def _workers(engine, tokenizer, rollout: RolloutConfig, options: SamplerOptions):
    """``(start, join)``: the ``hf`` workers' sampler, and what an sp group's other processes run."""
    from microrl.rollout.samplers.hf_pool import AsyncRolloutPool, check_num_workers
    from microrl.rollout.samplers.hf_worker import AsyncRollout
    from microrl.rollout.samplers.sp_group import HFPushJoiner

    workers = check_num_workers(rollout.num_workers)

    def start() -> Sampler:
        if workers == 1:
            return AsyncRollout(engine, tokenizer, options)
        return AsyncRolloutPool(engine, tokenizer, options, num_workers=workers)

    return start, lambda: HFPushJoiner(engine, tokenizer, num_workers=workers)


def _servers(engine, tokenizer, rollout: RolloutConfig, options: SamplerOptions, log_dir):
    """``(start, join)``: the vLLM servers' sampler, and what an sp group's other processes run."""
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout, check_arguments
    from microrl.rollout.weights.server_syncs import ServerSyncJoiner

    urls = rollout.server.urls
    workers = rollout.num_workers
    check_arguments(engine, rollout.vllm, urls, workers)  # on every process

    def start() -> Sampler:
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
            engine, tokenizer, version=options.version, urls=urls, num_workers=workers
        )

    return start, join
