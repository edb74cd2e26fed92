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

import torch
import torch.distributed as dist

from . import vocab_parallel as vp
from ._checks import IGNORE_INDEX
from ._dispatch import check_implementation, head_implementation, record
from ._tiles import _zero_unkept
from .chunked_loss import VocabShard, loss_plan, run_chunked
from .fused_loss import (
    FusedLossOutput,
    GroupLossFn,
    _check_segments,
    _FusedLinearLoss,
    _group_plan,
    _groups,
    _loss_plan,
    _record_group,
    _Spec,
)
from .linear_logprob import _backward, _compute_dtype, _plan

__all__ = ["vocab_parallel_linear_loss"]


def _run_sharded(shard: VocabShard, hidden, weight, bias, targets, row_mask, inv_t, spec: _Spec):
    """``fused_loss._run`` on a vocabulary shard (module docstring)."""
    need_h, need_w, need_b = spec.need
    need_b = need_b and bias is not None
    cdtype = _compute_dtype(hidden, weight, bias)
    n, real = hidden.shape[0], shard.real_rows
    logprob = hidden.new_empty(n, dtype=cdtype)
    entropy = hidden.new_empty(n, dtype=cdtype) if spec.plan.with_entropy else None
    grad_h = hidden.new_empty(hidden.shape) if need_h else None
    grad_w = weight.new_zeros(weight.shape, dtype=cdtype) if need_w else None  # padding rows: 0
    grad_b = bias.new_zeros(bias.shape, dtype=cdtype) if need_b else None
    any_grad = need_h or need_w or need_b
    local_targets = targets - shard.vocab_start
    losses = []
    for start, end in spec.groups:
        rows = slice(start, end)
        h, t = hidden[rows], local_targets[rows]
        mask = None if row_mask is None else row_mask[rows]
        inv = None if inv_t is None else inv_t[rows]
        plan = _group_plan(spec.plan, end - start, any_grad)
        kept: tuple[list, list, int] = ([], [], plan.kept_tiles if real else 0)
        local = vp._local_stats(
            h, weight, bias, targets[rows], None, mask, inv, _vp_plan(shard, plan), cdtype, kept
        )
        row_max, total, a, shifted = vp._combine(local, t, _vp_plan(shard, plan))
        log_sum = total.log()
        lp = _zero_unkept(shifted - log_sum, mask)
        ent_all = log_sum - a / total if a is not None else None
        ent = None if ent_all is None else _zero_unkept(ent_all, mask)
        g_lp, g_ent = _record_group(spec, start, end, (lp, ent), (logprob, entropy), losses)
        if not any_grad:
            continue
        if g_lp is None and g_ent is None:  # the loss does not depend on these rows
            if need_h:
                grad_h[rows] = 0.0
            continue
        gh = h.new_zeros(h.shape, dtype=cdtype) if need_h else None
        if real:
            saved = (h, weight[:real], None if bias is None else bias[:real], t, None, mask, inv)
            stats = (row_max, total, ent_all, *kept[0], *kept[1])
            acc = None if grad_w is None else grad_w[:real]
            gh_local, _, gb = _backward(
                (*saved, *stats), len(kept[0]), plan, spec.need, g_lp, g_ent, grad_w_acc=acc
            )
            del kept, stats
            if need_h:
                gh.copy_(gh_local)
            if need_b:
                grad_b[:real] += gb.to(cdtype)
        if need_h:  # the shard's partial sum: the group's sum is the full hidden gradient
            vp._all_reduce(gh, dist.ReduceOp.SUM, shard.group)
            grad_h[rows] = gh
    total_loss = torch.stack(losses).sum() if losses else hidden.new_zeros((), dtype=cdtype)
    return total_loss, logprob, entropy, (grad_h, grad_w, grad_b)


def _vp_plan(shard: VocabShard, plan) -> vp._Plan:
    """The vocab-parallel plan with the single-device group plan's tiles (the same loop order)."""
    return vp._Plan(
        group=shard.group,
        vocab_start=shard.vocab_start,
        real_rows=shard.real_rows,
        rows=plan.rows,
        vocab_tile=plan.vocab_tile,
        with_entropy=plan.with_entropy,
        inv_temperature=plan.inv_temperature,
        scale=plan.scale,
        softcap=plan.softcap,
    )


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
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    validate: bool = True,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    implementation: str = "auto",
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
    check_implementation(implementation)
    inputs = vp.checked_inputs(
        hidden, weight, targets, group, vocab_start, vocab_size, temperature, with_entropy,
        chunk_size, ignore_index, validate, bias, logit_scale, softcap,
    )  # fmt: skip
    hidden_2d, local_w, local_b, flat_targets, valid, temp, inv_t, count = inputs[:8]
    group, vocab_start, vocab_size = inputs[8:]
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    n = flat_targets.numel()
    bounds = _check_segments(segments, n)
    if inv_t is not None:  # an ignored position's temperature is never used
        inv_t = torch.where(valid, inv_t, 1.0)
    grad_on = torch.is_grad_enabled()
    need = (
        grad_on and hidden.requires_grad,
        grad_on and local_w.requires_grad,
        grad_on and local_b is not None and local_b.requires_grad,
    )
    real = max(0, min(local_w.shape[0], vocab_size - vocab_start))
    inv_scalar = 1.0 / temp if not isinstance(temp, torch.Tensor) else 1.0
    scale, cap = float(logit_scale), None if softcap is None else float(softcap)
    vocab = max(1, real)  # a shard of padding only: plans as one row, runs no tile
    shard = VocabShard(group, vocab_start, real)
    impl = head_implementation(hidden_2d, local_w, local_b, implementation)
    record(impl, hidden_2d, "vocab_parallel_linear_loss")
    if impl == "tiles":
        base = _plan(
            max(1, n), vocab, chunk_size, with_entropy, inv_scalar, (True, True), False,
            hidden_2d.shape[1], scale, cap,
        )  # fmt: skip
        plan = _loss_plan(base, vocab, chunk_size)
        run = partial(_run_sharded, shard)
    else:
        masked = count != n  # validate=False, or some row ignored; else row blocks are views
        plan = loss_plan(
            hidden_2d, local_w, local_b, impl, max(1, n), need, with_entropy=with_entropy,
            inv_scalar=inv_scalar, scale=scale, softcap=cap, chunk_size=chunk_size, vocab=vocab,
            row_copies=masked,
        )  # fmt: skip
        run = partial(run_chunked, shard)
        valid = valid if masked else None
    spec = _Spec(_groups(bounds, plan.rows), plan, need, loss_fn, run=run)
    out = _FusedLinearLoss.apply(hidden_2d, local_w, local_b, flat_targets, valid, inv_t, spec)
    loss, logprob = out[0], out[1]
    entropy = out[2].view(targets.shape) if with_entropy else None
    return FusedLossOutput(loss, logprob.view(targets.shape), entropy, spec.aux)
