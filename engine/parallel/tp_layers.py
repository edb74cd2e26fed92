"""Tensor-parallel layers that compute on local shards; the parameters stay ``DTensor``s.

The forwards read ``param.to_local()`` and communicate Megatron-LM style: :class:`CopyToGroup`
before a column-parallel layer, :class:`ReduceFromGroup` after a row-parallel one (DTensor
re-plans per input shape: seconds per new micro-batch width on a CPU). Every tp rank calls a
layer with the same input, but a row-parallel one (its slice of the last dimension).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CopyToGroup",
    "ReduceFromGroup",
    "install_colwise",
    "install_gathered_head",
    "install_local_params",
    "install_rowwise",
    "install_vocab_embedding",
]


class CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient of the replicated input over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromGroup(torch.autograd.Function):
    """``all_reduce(SUM)`` forward of partial sums; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather ``[..., V_local]`` chunks into ``[..., V]``; the backward keeps this rank's
    slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, start: int, size: int):
        chunk = -(-size // dist.get_world_size(group))
        padded = F.pad(x, (0, chunk - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, padded, group=group)
        ctx.span = start, x.shape[-1]
        return torch.cat(parts, dim=-1)[..., :size]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, width = ctx.span
        return grad[..., start : start + width], None, None, None


def _local(param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else param.to_local()


def _colwise_forward(self: nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    # [..., in] replicated -> [..., out / t]: this rank's output features.
    return F.linear(CopyToGroup.apply(x, group), _local(self.weight), _local(self.bias))


def _rowwise_forward(self: nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    # [..., in / t] this rank's input features -> [..., out] replicated; bias added after the sum.
    out = ReduceFromGroup.apply(F.linear(x, _local(self.weight)), group)
    return out if self.bias is None else out + _local(self.bias)


def install_colwise(linear: nn.Linear, group: dist.ProcessGroup) -> None:
    """``linear`` (weight and bias ``Shard(0)`` DTensors) computes its output slice."""
    linear.forward = partial(_colwise_forward, linear, group)


def install_rowwise(linear: nn.Linear, group: dist.ProcessGroup) -> None:
    """``linear`` (weight ``Shard(1)``, bias ``Replicate()``) sums its partial outputs."""
    linear.forward = partial(_rowwise_forward, linear, group)


def install_gathered_head(linear: nn.Linear, group: dist.ProcessGroup, start: int) -> None:
    """The vocab-sharded lm head called as a module (``generate``): local logits all-gathered into
    ``[..., V]``. Training reads the weight shard through the vocab-parallel kernel instead."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        local = _colwise_forward(linear, group, x)
        return _GatherLastDim.apply(local, group, start, linear.weight.shape[0])

    linear.forward = forward


def install_vocab_embedding(embedding: nn.Embedding, group: dist.ProcessGroup, start: int) -> None:
    """The vocab-sharded embedding: each rank looks up the ids of its rows, zeros the rest, and the
    partial embeddings are summed (no ``[V, H]`` gradient is formed)."""
    for name in ("max_norm", "sparse", "scale_grad_by_freq"):
        if getattr(embedding, name):
            raise ValueError(f"tensor parallelism: the input embedding's {name} is not supported")

    def forward(ids: torch.Tensor) -> torch.Tensor:
        weight = embedding.weight.to_local()
        local = ids - start
        inside = (local >= 0) & (local < weight.shape[0])
        pad = embedding.padding_idx
        pad = pad - start if pad is not None and 0 <= pad - start < weight.shape[0] else None
        out = F.embedding(torch.where(inside, local, 0), weight, pad)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return ReduceFromGroup.apply(out, group)

    embedding.forward = forward


def install_local_params(
    module: nn.Module, group: dist.ProcessGroup, *, partial_grads: bool = False
) -> None:
    """Run ``module``'s own forward on the local tensors of its replicated DTensor parameters,
    shadowed as instance attributes during the call; ``partial_grads``: it computes on this
    rank's heads (Qwen3's ``q_norm``), so its weight gradient is summed (:class:`CopyToGroup`)."""
    names = [
        name
        for name, p in module.named_parameters(recurse=False)
        if hasattr(p, "to_local") and p is not None
    ]

    def shadow(mod: nn.Module, args: Any) -> None:
        for name in names:
            local = mod._parameters[name].to_local()
            if partial_grads and local.requires_grad:
                local = CopyToGroup.apply(local, group)
            mod.__dict__[name] = local

    def unshadow(mod: nn.Module, args: Any, output: Any) -> None:
        for name in names:
            mod.__dict__.pop(name, None)

    if names:
        module.register_forward_pre_hook(shadow)
        module.register_forward_hook(unshadow, always_call=True)
