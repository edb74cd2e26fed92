"""Optimizer, learning-rate schedule, guarded step and the gradient-flow audit."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import nn

from microrl.configs.engine import OptimConfig, Schedule
from microrl.engine.parallel import distributed

__all__ = [
    "audit_grad_flow",
    "audit_vision_tower",
    "build_optimizer",
    "build_scheduler",
    "clip_and_check",
    "clip_host_shards",
    "grad_flow_report",
    "lr_factor",
]

logger = logging.getLogger(__name__)


def build_optimizer(params: Iterable[nn.Parameter], config: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (default) or SGD over the trainable parameters."""
    params = list(params)
    if not params:
        raise ValueError("the model has no trainable parameter (requires_grad=True)")
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )


def lr_factor(step: int, config: OptimConfig) -> float:
    """Multiplier of ``optim.lr`` at optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps`` (the first step at ``1 / warmup_steps``, never 0), then constant, cosine or
    linear decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule is Schedule.CONSTANT:
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    if config.schedule is Schedule.COSINE:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule of :func:`lr_factor` (stepped once per successful optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))


def apply_optim_config(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR | None,
    config: OptimConfig,
) -> None:
    """Give a loaded optimizer (and schedule) the hyper-parameters of ``config``: a checkpoint's
    saved param groups would silently undo a changed ``optim.lr`` on resume. An unchanged config
    writes back the restored values (``lr = base_lr * factor(step)`` as ``LambdaLR``): exact."""
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"] = config.lr
        group["weight_decay"] = config.weight_decay
        if "betas" in group:
            group["betas"] = tuple(config.betas)
        if "eps" in group:
            group["eps"] = config.eps
    if scheduler is not None:  # LambdaLR: lr = base_lr * factor(steps taken)
        scheduler.base_lrs = [config.lr for _ in optimizer.param_groups]
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = config.lr * factor(scheduler.last_epoch)


def clip_and_check(params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Global grad norm (clipping to ``max_norm`` when set); a 0-d tensor, possibly non-finite.
    FSDP's DTensor shards reduce in ``clip_grad_norm_``; host-offloaded shards on an accelerator
    mesh (NCCL cannot reduce host tensors) go through :func:`clip_host_shards`."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    limit = float("inf") if max_norm is None else max_norm
    if any(_is_offloaded(p.grad) for p in with_grad):
        return clip_host_shards(with_grad, limit)
    return torch.nn.utils.clip_grad_norm_(with_grad, limit, error_if_nonfinite=False)


def _is_offloaded(grad: torch.Tensor) -> bool:
    """A DTensor gradient shard in host memory on a mesh of an accelerator (FSDP2 CPU offload)."""
    mesh = getattr(grad, "device_mesh", None)
    return mesh is not None and grad.device.type != mesh.device_type


@torch.no_grad()
def clip_host_shards(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """:func:`clip_and_check` for FSDP2 ``DTensor`` gradient shards (a 1-D mesh) wherever they
    live: local norms, one scalar all-reduce on the mesh's device, in-place scaling as
    ``clip_grad_norm_``'s. Returns the global norm (a 0-d host tensor; nan/inf if non-finite)."""
    grads = [p.grad.to_local() for p in params]
    nonempty = [g for g in grads if g.numel()]
    norms = torch._foreach_norm(nonempty, 2.0) if nonempty else []
    local = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())
    mesh = params[0].grad.device_mesh
    device = mesh.device_type
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    squares = local.float().square().to(device)
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=mesh.get_group())
    total = squares.sqrt().to(local.device)
    if math.isfinite(max_norm) and nonempty:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(nonempty, scale.to(nonempty[0].dtype))
    return total


def grad_flow_report(named_params: list[tuple[str, nn.Parameter]]) -> list[str]:
    """Names of trainable parameters whose gradient is ``None`` or all zero: one fused
    reduction and one host sync; FSDP shards' maxima are all-reduced, so every rank agrees."""
    dead = [name for name, p in named_params if p.grad is None]
    with_grad = [(name, p.grad) for name, p in named_params if p.grad is not None]
    if with_grad:
        grads = [g.to_local() if hasattr(g, "to_local") else g for _, g in with_grad]
        nonempty = [g for g in grads if g.numel()]
        maxima = iter(torch._foreach_norm(nonempty, float("inf")) if nonempty else [])
        norms = torch.stack(
            [
                next(maxima).float() if g.numel() else g.new_zeros((), dtype=torch.float32)
                for g in grads
            ]
        )
        group = _shard_group(g for _, g in with_grad)
        if group is not None:
            # Offloaded gradient shards are host tensors: reduced where the group can.
            norms = distributed.all_reduce(norms, dist.ReduceOp.MAX, group)
        zero = (norms == 0).tolist()
        dead += [name for (name, _), is_zero in zip(with_grad, zero, strict=True) if is_zero]
    return dead


def _shard_group(grads) -> dist.ProcessGroup | None:
    """The process group a sharded (DTensor) gradient is split over (every rank on a 2-D
    mesh, whose shards span both dimensions); None if none is sharded."""
    for grad in grads:
        mesh = getattr(grad, "device_mesh", None)
        if mesh is not None:
            return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
    return None


def audit_grad_flow(
    module: nn.Module, loss_mask: torch.Tensor, mode: str, *, skip: Collection[int] = ()
) -> None:
    """Warn (``mode="warn"``) or raise ``RuntimeError`` (``"error"``) naming the trainable
    parameters of ``module`` a backward with loss tokens (on any rank) left without gradient;
    ``skip``: ids not expected to get one (a vision tower without images), same on every rank."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in skip]
    has_tokens = loss_mask.any().float().reshape(1)
    group = _shard_group(p for _, p in named)
    if group is not None:  # every rank must take the same branch: the report is collective
        dist.all_reduce(has_tokens, op=dist.ReduceOp.MAX, group=group)
    if not bool(has_tokens):
        return
    dead = grad_flow_report(named)
    if dead:
        _report(f"trainable parameters without gradient: {_shown(dead)}", mode)


def audit_vision_tower(
    module: nn.Module, tower: Collection[int], *, frozen: bool, key: str, mode: str
) -> None:
    """The ``freeze_vision`` half of the audit, naming ``key``: frozen, no parameter of
    ``tower`` (ids) may be trainable or hold a gradient; not frozen, one must be trainable."""
    named = [(n, p) for n, p in module.named_parameters() if id(p) in tower]
    leaks = [n for n, p in named if p.requires_grad or p.grad is not None]
    if frozen and leaks:
        _report(
            f"{key}=True, but vision tower parameters are trainable or hold a gradient: "
            f"{_shown(leaks)}",
            mode,
        )
    elif not frozen and not any(p.requires_grad for _, p in named):
        _report(f"{key}=False, but no vision tower parameter is trainable", mode)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


def _report(problem: str, mode: str) -> None:
    """The audit's finding: a ``RuntimeError`` for ``mode="error"``, else a warning."""
    if mode == "error":
        raise RuntimeError(f"grad-flow audit: {problem}")
    logger.warning("grad-flow audit: %s", problem)
