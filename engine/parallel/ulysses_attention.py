"""Ulysses attention: all-to-alls around the model's own attention under sequence parallelism.

Attention needs the whole sequence: an all-to-all per query, key and value turns "``H`` heads of
``S/s`` tokens" into "``H/s`` heads of ``S`` tokens", the model's own attention runs, and one
all-to-all brings the output back. Registered as ``microrl_ulysses_<base>`` through transformers'
``AttentionInterface``; without the ``SequenceShard`` keyword (``generate``) it is the base
implementation. Layout: docs/distributed.md#sequence-parallelism-ulysses.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from microrl.engine.parallel.varlen_attention import (
    PACKED_LENGTHS_KWARG,
    VARLEN_PREFIX,
    varlen_attention,
)

if TYPE_CHECKING:
    from microrl.engine.parallel.sequence_parallel import SequenceShard

__all__ = [
    "BASES",
    "SHARD_KWARG",
    "all_to_all",
    "check_heads",
    "enable_ulysses_attention",
    "flash_varlen_kwargs",
    "is_flash",
    "join_chunks",
    "kv_head_repeats",
    "split_chunks",
    "ulysses_attention",
    "wrapper_name",
]

#: The model keyword argument that carries the micro-batch's ``SequenceShard`` to attention.
SHARD_KWARG = "microrl_sequence_shard"
#: Attention implementations the Ulysses wrapper runs; besides these, any other that transformers
#: runs through its flash-attention function (:func:`is_flash`: a hub kernel such as
#: ``kernels-community/flash-attn2``, which ``flash_attention_2`` becomes without flash_attn).
BASES = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_PREFIX = "microrl_ulysses_"
#: Registered wrapper name -> its base implementation (a flash base's name is rewritten).
_WRAPPED: dict[str, str] = {}


def is_flash(base: str | None) -> bool:
    """Whether transformers runs ``base`` through its flash-attention function
    (``flash_attention_2``, ``_3``, ``_4``, hub kernels), whose varlen path takes
    :func:`flash_varlen_kwargs`."""
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return base is not None and ALL_ATTENTION_FUNCTIONS.get(base) is flash_attention_forward


def wrapper_name(base: str) -> str:
    """``microrl_ulysses_<base>``, "flash" written "fa" and "/" "--": transformers would import a
    name with "flash" as flash-attention, an ``org/repo`` as a hub kernel."""
    if not is_flash(base):
        return f"{_PREFIX}{base}"
    return _PREFIX + base.replace("flash", "fa").replace("/", "--")


def base_implementation(name: str | None) -> str | None:
    """The plain implementation under a wrapper name (``microrl_varlen_sdpa`` -> ``sdpa``)."""
    if name in _WRAPPED:
        return _WRAPPED[name]
    for prefix in (_PREFIX, VARLEN_PREFIX):
        if name is not None and name.startswith(prefix):
            return name[len(prefix) :]
    return name


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raise ``ValueError`` naming ``sequence_parallel_size`` unless ``size`` divides the query
    heads (key/value heads are replicated instead: :func:`kv_head_repeats`)."""
    if num_heads % size or num_heads % num_kv_heads:
        raise ValueError(
            f"sequence_parallel_size={size} must divide the model's num_attention_heads "
            f"({num_heads}; num_key_value_heads={num_kv_heads}): Ulysses attention gives each "
            "rank num_attention_heads / sequence_parallel_size heads"
        )


def kv_head_repeats(num_kv_heads: int, size: int) -> int:
    """Copies of each key/value head that make their count divisible by ``size``."""
    return size // math.gcd(num_kv_heads, size)


def split_chunks(x: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """``x`` cut into ``size`` chunks along ``dim``, stacked ``[size, ...]`` (chunk ``j`` to rank
    ``j``)."""
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of {tuple(x.shape)} does not divide by {size}")
    return torch.stack(x.chunk(size, dim=dim)).contiguous()


def join_chunks(chunks: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`split_chunks`: the received chunks concatenated along ``dim``."""
    return torch.cat(chunks.unbind(0), dim=dim)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int):
    size = dist.get_world_size(group)
    send = split_chunks(x, size, scatter)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return join_chunks(received, gather)


class _AllToAll(torch.autograd.Function):
    """Scatter ``scatter`` over the group, gather ``gather``; the backward is the inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, scatter: int, gather: int):
        ctx.args = group, scatter, gather
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, scatter, gather = ctx.args
        return _exchange(grad.contiguous(), group, gather, scatter), None, None, None


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Differentiable all-to-all: ``[b, H, S/s, D]`` with ``(1, 2)`` -> ``[b, H/s, S, D]``."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def enable_ulysses_attention(model: nn.Module, size: int) -> str:
    """Switch ``model`` to the Ulysses wrapper of its attention implementation; returns the base.

    Raises:
        ValueError: naming ``sequence_parallel_size``: an implementation other than SDPA, eager or
            flash-attention, or heads that ``size`` ranks cannot split.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    current = getattr(config, "_attn_implementation", None)
    base = base_implementation(current)
    if base not in ("sdpa", "eager") and not is_flash(base):
        raise ValueError(
            f"sequence_parallel_size={size} supports the sdpa, eager and flash-attention "
            f"({', '.join(BASES[2:])}) attention implementations, got {current!r}; load the "
            "model with attn_implementation='sdpa' or 'flash_attention_2'"
        )
    heads = config.num_attention_heads
    check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, size)
    name = wrapper_name(base)
    _WRAPPED[name] = base
    AttentionInterface.register(name, partial(ulysses_attention, base=base))
    # With a shard the engine passes a placeholder mask, so no [S/s, S/s] mask is ever built.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    if current != name:
        model.set_attn_implementation(name)
    return base


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    base: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``base`` attention over the whole sequence from this rank's tokens: ``query``
    ``[b, H, S/s, D]``, ``key``/``value`` ``[b, Hkv, S/s, D]`` (RoPE applied) -> ``[b, S/s, H, D]``;
    without a shard in ``kwargs``, the ``base`` implementation itself."""
    shard: SequenceShard | None = kwargs.pop(SHARD_KWARG, None)
    flash = is_flash(base)
    if shard is None:
        if flash:
            return _flash_attention(module, query, key, value, attention_mask, base=base, **kwargs)
        return varlen_attention(module, query, key, value, attention_mask, base=base, **kwargs)
    shard.attention_calls += 1
    kwargs.pop(PACKED_LENGTHS_KWARG, None)
    # This rank's position ids describe no gathered sequence (flash would seek packed rows).
    kwargs.pop("position_ids", None)
    group, size = shard.group, shard.size
    repeats = kv_head_repeats(key.shape[1], size)
    if repeats > 1:  # [b, Hkv, ..] -> [b, Hkv * r, ..]: head j becomes heads j*r .. j*r + r - 1
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    # [b, H, S/s, D] -> [b, H/s, S, D]: every token of the sequence, this rank's heads.
    query, key, value = (all_to_all(t, group, 1, 2) for t in (query, key, value))
    if flash:  # one call over the gathered rows; the kernel keeps the sequences apart
        if shard.flash_varlen is None:  # once per micro-batch, not once per layer
            shard.flash_varlen = flash_varlen_kwargs(
                shard.attention_lengths, query.shape[0], query.device
            )
        out, _ = _flash_attention(
            module, query, key, value, None, base=base, **{**kwargs, **shard.flash_varlen}
        )
        return all_to_all(out, group, 1, 2), None
    groups = query.shape[1] // key.shape[1]  # query heads per key/value head on this rank
    previous = getattr(module, "num_key_value_groups", None)
    if previous is not None and previous != groups:  # read by repeat_kv in SDPA and eager
        module.num_key_value_groups = groups
    try:
        out, _ = varlen_attention(
            module,
            query,
            key,
            value,
            None,
            base=base,
            **{PACKED_LENGTHS_KWARG: shard.attention_lengths},
            **kwargs,
        )
    finally:
        if previous is not None:
            module.num_key_value_groups = previous
    # [b, S, H/s, D] -> [b, S/s, H, D]: this rank's tokens, every head.
    return all_to_all(out, group, 1, 2), None


def flash_varlen_kwargs(
    lengths: tuple[int, ...], rows: int, device: torch.device | str
) -> dict[str, Any]:
    """transformers' flash-attention varlen arguments for ``rows`` rows of sequences ``lengths``:
    ``cu_seq_lens_q/k``, int32 offsets in the flattened ``[rows * width]`` tokens, and
    ``max_length_q/k``, a host int. A padded row is one sequence, causal as in one process."""
    offsets, end = [0], 0
    for _ in range(rows):
        for length in lengths:
            end += length
            offsets.append(end)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    longest = max(lengths)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


class _ReadThrough:
    """``target`` with some attributes replaced; every other attribute is read from ``target``."""

    def __init__(self, target: Any, **replaced: Any) -> None:
        vars(self).update(replaced, _target=target)

    def __getattr__(self, name: str) -> Any:
        return getattr(vars(self)["_target"], name)


def _flash_attention(
    module: nn.Module, *tensors: torch.Tensor | None, base: str, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """transformers' flash-attention function for ``base`` (``[b, H, S, D]`` -> ``[b, S, H, D]``),
    given ``module`` with a config naming ``base``: the kernel is picked by that name."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = _ReadThrough(module.config, _attn_implementation=base)
    attend = ALL_ATTENTION_FUNCTIONS[base]
    return attend(_ReadThrough(module, config=config), *tensors, **kwargs)
