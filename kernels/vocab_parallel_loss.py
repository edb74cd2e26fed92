"""Vocab-parallel fused loss: :func:`microrl.kernels.fused_linear_loss` with the lm head's
vocabulary split over a tensor-parallel group.

Per row group, as on one device (``kernels/fused_loss.py``), but on this rank's shard:

1. the shard's online statistics of the group's rows (``vocab_parallel._local_stats``), keeping
   its logits tiles (``z - m_tile``) within the same budget as the single-device fused loss;
2. the exact combination over the group (``vocab_parallel._combine``: the max first, then the
   rescaled sums; two all-reduces of O(rows)), giving the group's log-probs and entropy,
   replicated on every rank;
3. the caller's ``loss_fn`` on them (every rank computes the same loss and upstream gradients);
4. the single-device kernel's backward (``linear_logprob._backward``) on the shard with the
   *global* row statistics: ``exp(z - m) / S`` of a local logit is its probability under the whole
   vocabulary, so the formula is unchanged; targets outside the shard fall outside every tile.
   The kept tiles are reused, the others recomputed; the shard's hidden-gradient partial sum is
   all-reduced over the group (``[rows, H]``), the weight and bias gradients stay local (zero on
   padding rows).

So the TP head costs what the single-device fused loss costs on ``V / t`` columns, and its
communication is the vocab-parallel kernel's: O(N) statistics in forward, the ``[N, H]`` hidden
gradient. Contract: ``docs/kernels.md`` ("Vocab-parallel").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import vocab_parallel as vp
from ._checks import head_dtype, head_spec
from ._tiles import _zero_unkept
from .chunked import VocabShard
from .fused_loss import (
    FusedLossOutput,
    GroupLossFn,
    _group_plan,
    _loss_buffers,
    _LossCall,
    _no_gradient,
    _record_group,
    _row_groups,
    _total,
    run_loss,
)
from .linear_logprob import _backward

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._checks import HeadOptions


__all__ = ["vocab_parallel_linear_loss"]


def _run_sharded(
    shard: VocabShard, hidden, weight, bias, targets, row_mask, inv_t, call: _LossCall
):
    """``fused_loss._run`` on a vocabulary shard (module docstring)."""
    need_h, need_w, need_b = call.need
    need_b = need_b and bias is not None
    cdtype = head_dtype(hidden, weight, bias)
    real = shard.real_rows
    logprob, entropy, grad_h, grad_w, grad_b = _loss_buffers(hidden, weight, bias, call, cdtype)
    any_grad = need_h or need_w or need_b
    local_targets = targets - shard.vocab_start
    losses = []
    for start, end, mask, inv in _row_groups(call, row_mask, inv_t):
        rows = slice(start, end)
        h, t = hidden[rows], local_targets[rows]
        plan = _group_plan(call.plan, end - start, any_grad)
        kept: tuple[list, list, int] = ([], [], plan.kept_tiles if real else 0)
        sharded = vp._Plan(shard, plan.rows, plan.vocab_tile, plan.spec)  # the same tiles
        local = vp._local_stats(
            h, weight, bias, targets[rows], None, mask, inv, sharded, cdtype, kept
        )
        row_max, total, a, shifted = vp._combine(local, t, shard)
        log_sum = total.log()
        lp = _zero_unkept(shifted - log_sum, mask)
        ent_all = log_sum - a / total if a is not None else None
        ent = None if ent_all is None else _zero_unkept(ent_all, mask)
        g_lp, g_ent = _record_group(call, start, end, (lp, ent), (logprob, entropy), losses)
        if _no_gradient(any_grad, g_lp, g_ent, grad_h, rows):
            continue
        gh = h.new_zeros(h.shape, dtype=cdtype) if need_h else None
        if real:
            saved = (h, weight[:real], None if bias is None else bias[:real], t, None, mask, inv)
            stats = (row_max, total, ent_all, *kept[0], *kept[1])
            acc = None if grad_w is None else grad_w[:real]
            gh_local, _, gb = _backward(
                (*saved, *stats), len(kept[0]), plan, call.need, g_lp, g_ent, grad_w_acc=acc
            )
            del kept, stats
            if need_h:
                gh.copy_(gh_local)
            if need_b:
                grad_b[:real] += gb.to(cdtype)
        if need_h:  # the shard's partial sum: the group's sum is the full hidden gradient
            vp._all_reduce(gh, dist.ReduceOp.SUM, shard.group)
            grad_h[rows] = gh
    return _total(losses, hidden, cdtype), logprob, entropy, (grad_h, grad_w, grad_b)


def vocab_parallel_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: GroupLossFn,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    segments: Sequence[int] | None = None,
    **head: Unpack[HeadOptions],
) -> FusedLossOutput:
    """:func:`microrl.kernels.fused_linear_loss` of an lm head whose vocabulary is split over a
    tensor-parallel group: every rank gets the single-device result on the whole vocabulary, to
    the compute dtype's rounding, without recomputing kept logits tiles in backward.

    Args:
        hidden, weight, targets, group, vocab_start, vocab_size, temperature, chunk_size,
        ignore_index, validate, bias, logit_scale, softcap: as in
            :func:`microrl.kernels.vocab_parallel_linear_logprob` (a ``Shard(0)`` DTensor weight
            and bias carry ``group`` and ``vocab_start``).
        loss_fn, segments, with_entropy: as in :func:`microrl.kernels.fused_linear_loss`; every
            rank calls ``loss_fn`` on the same (replicated) log-probs and must return the same
            loss.
        implementation: as in :func:`microrl.kernels.fused_linear_logprob` (every rank must
            take the same one).

    Returns:
        :class:`FusedLossOutput`, identical on every rank. Gradients (formed in forward, handed
        out by ``loss.backward()``): the hidden gradient is the sum over the group (the full one),
        the weight and bias gradients are the shard's own.

    Raises:
        TypeError, ValueError: as the two functions above.
    """
    spec, temperature, bias = head_spec("vocab_parallel_linear_loss", head, with_entropy=False)
    spec, inputs, shard = vp.checked_inputs(
        hidden, weight, targets, temperature, bias, spec, group, vocab_start, vocab_size
    )
    return run_loss(
        inputs, targets.shape, loss_fn, segments, spec, "vocab_parallel_linear_loss",
        shard=shard, tiles_run=partial(_run_sharded, shard),
    )  # fmt: skip
