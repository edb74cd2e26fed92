"""Sequence parallelism (Ulysses): each rank of an sp group holds 1/s of every micro-batch's tokens.

The ``s`` ranks of an sp group pass the same mini-batch (:func:`check_same_batch`) and each
takes an equal slice of its tokens (:class:`SequenceShard`); outputs are all-gathered back, so
loss and metrics are the whole micro-batch's on every sp rank. FSDP2 averages over all
``dp x sp`` ranks, hence ``grad_scale = dp * sp`` (:func:`scale_denominators`).
Details: docs/distributed.md#sequence-parallelism-ulysses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy

from microrl.engine.parallel import distributed
from microrl.engine.parallel.tensor_parallel import SUPPORTED_MODEL_TYPES, dp_by_mesh
from microrl.engine.parallel.tp_layers import ReduceFromGroup
from microrl.engine.parallel.ulysses_attention import (
    SHARD_KWARG,
    check_heads,
    enable_ulysses_attention,
)
from microrl.engine.parallel.varlen_attention import PACKED_LENGTHS_KWARG
from microrl.kernels import IGNORE_INDEX
from microrl.losses.aggregation import LossDenominators

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SequenceShard",
    "ShardedGroupLoss",
    "check_same_batch",
    "check_supported",
    "init_mesh",
    "scale_denominators",
    "shard_model_inputs",
    "split_sequence",
    "wrap",
]


def init_mesh(sequence_parallel_size: int, device: torch.device) -> DeviceMesh | None:
    """The ``("dp", "sp")`` mesh (``tensor_parallel.dp_by_mesh``), or None for ``s == 1``."""
    return dp_by_mesh(sequence_parallel_size, "sequence_parallel_size", "sp", device)


def check_supported(config: Any, size: int) -> None:
    """Whether Ulysses attention is tested for this model config with ``size`` ranks.

    Raises:
        ValueError: naming ``sequence_parallel_size``: a family other than Qwen2, Qwen3 and
            Llama, sliding-window attention, or attention heads ``size`` does not divide.
    """
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"sequence_parallel_size={size}: model family {family!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        raise ValueError(
            f"sequence_parallel_size={size} does not support sliding-window attention "
            f"({family} with use_sliding_window)"
        )
    heads = config.num_attention_heads
    check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, size)


def wrap(
    module: nn.Module, mesh: DeviceMesh, *, offload_policy: OffloadPolicy | None = None
) -> nn.Module:
    """Switch the model inside ``module`` to Ulysses attention and shard ``module`` with FSDP2 over
    all ``dp x sp`` ranks (``offload_policy``: ``optim.cpu_offload``'s)."""
    size = mesh["sp"].size()
    model = next((m for m in module.modules() if hasattr(m, "set_attn_implementation")), None)
    if model is None:
        raise TypeError(f"found no transformers model inside {type(module).__name__}")
    check_supported(model.config, size)
    enable_ulysses_attention(model, size)
    return distributed.shard_model(module, offload_policy=offload_policy)


def padded_width(width: int, size: int) -> int:
    """``width`` rounded up to a multiple of ``size``."""
    return -(-width // size) * size


def split_sequence(x: torch.Tensor, size: int, rank: int, fill: float | int) -> torch.Tensor:
    """Rank ``rank``'s slice ``[b, W', ...]`` of ``x`` ``[b, W, ...]`` padded with ``fill`` to
    ``padded_width(W, size)``: ``W' = ceil(W / size)``."""
    width = x.shape[1]
    pad = padded_width(width, size) - width
    if pad:
        shape = (x.shape[0], pad, *x.shape[2:])
        x = torch.cat([x, x.new_full(shape, fill)], dim=1)
    local = x.shape[1] // size
    return x[:, rank * local : (rank + 1) * local]


class _GatherSequence(torch.autograd.Function):
    """All-gather ``[b, W', ...]`` into ``[b, W, ...]``; the backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, rank: int, width: int):
        size = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.args = size, rank, x.shape[1]
        return torch.cat(parts, dim=1)[:, :width]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size, rank, local = ctx.args
        pad = local * size - grad.shape[1]
        if pad:
            grad = F.pad(grad, (0, 0) * (grad.dim() - 2) + (0, pad))
        return grad[:, rank * local : (rank + 1) * local].contiguous(), None, None, None


@dataclasses.dataclass(eq=False)
class SequenceShard:
    """One micro-batch's split over an sp group: this rank's slice of its token dimension.

    Attributes:
        group, size, rank: the sp group, its size ``s`` and this rank's index in it.
        rows: the micro-batch's rows ``b`` (its sequences).
        width: ``L`` of padded ``[b, L]`` rows or ``N`` of a packed ``[1, N]`` row; padded to
            :attr:`padded` and split into ``s`` slices of :attr:`local` tokens.
        attention_lengths: the per-sequence attention lengths over the gathered dimension (packed
            lengths and the padding tail, or the padded width for rows).
        last_local: ``[b]`` bool, whether each sequence's last real token is on this rank.
        attention_calls: counted by the attention wrapper (checks the shard reached the model).
        flash_varlen: flash-attention's varlen arguments, built once by the first attention call.
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    rows: int
    width: int
    attention_lengths: tuple[int, ...]
    last_local: torch.Tensor | None = None
    attention_calls: int = 0
    flash_varlen: dict[str, Any] | None = dataclasses.field(default=None, repr=False)

    @property
    def padded(self) -> int:
        return padded_width(self.width, self.size)

    @property
    def local(self) -> int:
        return self.padded // self.size

    def split(self, x: torch.Tensor, fill: float | int) -> torch.Tensor:
        """This rank's ``[b, W', ...]`` slice of ``x`` ``[b, W, ...]``."""
        return split_sequence(x, self.size, self.rank, fill)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[b, W', ...]`` per rank -> ``[b, W, ...]`` on every rank, differentiable."""
        return _GatherSequence.apply(x, self.group, self.rank, self.width)

    def localize_last_index(self, last_index: torch.Tensor) -> torch.Tensor:
        """Flat indices into the full ``[b, W]`` inputs -> into this rank's ``[b, W']`` slice (the
        row's first local token where the last is on another rank); sets :attr:`last_local`."""
        row, col = last_index // self.width, last_index % self.width
        self.last_local = col // self.local == self.rank
        local_col = torch.where(self.last_local, col % self.local, 0)
        return row * self.local + local_col

    def gather_outputs(self, raw: Mapping[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
        """A role's raw outputs on this rank's slice -> the whole micro-batch's, on every rank:
        per-position ``[b, W']`` all-gathered into ``[b, W]``; per-row ``[b]`` values summed over
        the group with the entries of ranks without the last token zeroed."""
        if self.attention_calls == 0:
            raise RuntimeError(
                f"sequence_parallel_size={self.size}: {role}._model_forward did not pass its "
                "**model_kwargs on to the transformers model, so attention never saw the "
                "sequence shard (it would have attended to this rank's tokens only)"
            )
        out = {}
        for key, value in raw.items():
            if value.dim() >= 2 and value.shape[1] == self.local:
                out[key] = self.gather(value)
            elif value.dim() == 1 and self.last_local is not None:
                zero = torch.zeros((), dtype=value.dtype, device=value.device)
                out[key] = ReduceFromGroup.apply(
                    torch.where(self.last_local, value, zero), self.group
                )
            else:
                raise ValueError(
                    f"sequence_parallel_size={self.size}: {role}._model_forward output {key!r} "
                    f"has shape {tuple(value.shape)}: expected per-position [.., {self.local}] "
                    "(this rank's tokens) or, from a role that takes last_index, per-row "
                    f"[{self.rows}]"
                )
        return out


class ShardedGroupLoss:
    """The engine's :class:`~microrl.engine.group_loss.GroupLoss` for a head that sees this rank's
    tokens only: the local log-probs (and entropy) are gathered over the sp group before the loss,
    so a per-sequence loss sees whole sequences; the backward hands the kernel this rank's slice."""

    def __init__(self, inner: Any, shard: SequenceShard, local_shape: tuple[int, int]) -> None:
        self.inner, self.shard, self.local_shape = inner, shard, local_shape
        self.segments = [0, local_shape[0] * local_shape[1]]

    def metrics(self) -> dict:
        return self.inner.metrics()

    def __call__(self, start: int, end: int, logprobs: torch.Tensor, entropy: torch.Tensor | None):
        if (start, end) != tuple(self.segments):
            raise RuntimeError(f"the fused loss split this rank's rows ({start}, {end})")
        full = self.inner.segments[-1]

        def gathered(t: torch.Tensor) -> torch.Tensor:
            return self.shard.gather(t.view(self.local_shape)).reshape(-1)[:full]

        return self.inner(
            0, full, gathered(logprobs), None if entropy is None else gathered(entropy)
        )


def shard_model_inputs(
    args: tuple[torch.Tensor, ...],
    kwargs: dict[str, Any],
    group: dist.ProcessGroup,
    packed_lengths: list[int] | None,
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], SequenceShard]:
    """The engine's model inputs for one micro-batch -> this rank's slice of them.

    ``args``: ``(input_ids, position_ids, attention_mask, targets)``, ``[b, L]`` padded rows or a
    packed ``[1, N]`` row (``packed_lengths``). Per-token tensors (a ``temperature`` too) are split;
    ``attention_mask`` becomes a 4-D placeholder transformers passes through (the wrapper masks
    itself); ``last_index`` is localised, ``group_loss`` wrapped, the shard a model keyword.
    """
    ids, positions, _, targets = args
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    width = ids.shape[1]
    if packed_lengths is not None:
        tail = padded_width(width, size) - width
        lengths = (*packed_lengths, tail) if tail else tuple(packed_lengths)
        rows = len(packed_lengths)
    else:
        lengths, rows = (padded_width(width, size),), ids.shape[0]
    shard = SequenceShard(group, size, rank, rows, width, lengths)
    mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=ids.device)
    local_args = (shard.split(ids, 0), shard.split(positions, 0), mask)
    local_args = (*local_args, shard.split(targets, IGNORE_INDEX))
    kwargs = dict(kwargs)
    kwargs.pop(PACKED_LENGTHS_KWARG, None)
    if isinstance(kwargs.get("temperature"), torch.Tensor):
        kwargs["temperature"] = shard.split(kwargs["temperature"], 1.0)
    if kwargs.get("last_index") is not None:
        kwargs["last_index"] = shard.localize_last_index(kwargs["last_index"])
    if kwargs.get("group_loss") is not None:
        local_shape = tuple(local_args[0].shape)
        kwargs["group_loss"] = ShardedGroupLoss(kwargs["group_loss"], shard, local_shape)
    kwargs[SHARD_KWARG] = shard
    return local_args, kwargs, shard


def scale_denominators(denominators: LossDenominators, size: int) -> LossDenominators:
    """``grad_scale`` times ``size``: FSDP2 averages sp ranks' gradients, parts of one sum."""
    return dataclasses.replace(denominators, grad_scale=denominators.grad_scale * size)


def check_same_batch(batch: TensorDict, group: dist.ProcessGroup) -> None:
    """Raise ``ValueError`` unless every sp rank passed the same mini-batch (one all-gather of a
    4-number fingerprint): a loader sharding by global rank would silently mix rows."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    weight = torch.arange(1, ids.numel() + 1, device=ids.device).view_as(ids)
    fingerprint = torch.stack(
        [
            torch.tensor(ids.shape[0], device=ids.device),
            torch.tensor(ids.shape[1], device=ids.device),
            (ids * weight).sum(),
            (mask.to(torch.int64) * weight).sum(),
        ]
    )
    parts = [torch.empty_like(fingerprint) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, fingerprint, group=group)
    if not bool((torch.stack(parts) == fingerprint).all()):
        raise ValueError(
            "the ranks of a sequence-parallel group (sequence_parallel_size > 1) must pass the "
            "same mini-batch: shard the data by engine.device_mesh['dp'].get_local_rank(), not "
            "by the global rank"
        )
