"""Fused lm-head loss: ``hidden @ weight.T`` -> log-probs -> a loss, its gradients formed in forward.

The plain fused kernel recomputes logits tiles in backward, because its upstream gradients are
unknown until the caller's loss has run. A loss made of per-group terms (every
``microrl.losses`` loss per sequence) gives each group's gradient as soon as that group's
log-probs exist. So :func:`fused_linear_loss` runs the loss inside the head, group by group, and
backward recomputes nothing: 4·N·H·V flops with a frozen head instead of up to 6. The contract
is docs/kernels.md ("The fused loss path"); the steps are its section "How the fused loss is
built".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ._checks import HeadInputs, HeadSpec, checked_inputs, head_dtype, head_spec, no_autocast
from ._dispatch import resolve
from .chunked import VocabShard
from .chunked_loss import loss_plan, run_chunked
from .linear_logprob import (
    _BUFFER_TILES,
    WORKING_TILE_ELEMENTS,
    _backward,
    _forward,
    _native16,
    _Plan,
    _plan,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._checks import HeadOptions


__all__ = ["FusedLossOutput", "GroupLossFn", "fused_linear_loss"]

#: ``loss_fn(start, end, logprobs, entropy) -> (loss, aux)``: the partial loss of the flattened
#: rows ``[start, end)`` (a 0-d tensor, a differentiable function of the ``[end - start]`` leaves
#: ``logprobs`` and ``entropy``, the latter None without ``with_entropy``) and anything the caller
#: wants back (metrics), collected in :attr:`FusedLossOutput.aux` in call order.
GroupLossFn = Callable[[int, int, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class FusedLossOutput:
    """What :func:`fused_linear_loss` returns.

    Attributes:
        loss: 0-d, the sum of the groups' losses, with gradients to ``hidden``, ``weight`` and
            ``bias`` (those that require grad), in the dtype ``loss_fn`` returned.
        logprobs: ``targets.shape``, detached, as ``fused_linear_logprob`` computes them.
        entropy: ``targets.shape``, detached, or None without ``with_entropy``.
        aux: the second value of every ``loss_fn`` call, in row order.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    aux: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class _LossCall:
    """Non-tensor arguments of the Function (``aux`` is filled in by its forward)."""

    groups: tuple[tuple[int, int], ...]
    # The plan of the tallest group: a _GroupPlan (tiles) or a chunked_loss.LossPlan, with the
    # call's HeadSpec (plan.spec).
    plan: Any
    need: tuple[bool, bool, bool]  # gradient to hidden, weight, bias
    loss_fn: GroupLossFn
    # The forward's loop: _run, vocab_parallel_loss._run_sharded or chunked_loss.run_chunked.
    run: Callable
    aux: list = field(default_factory=list)


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, hidden, weight, bias, targets, row_mask, inv_t, call: _LossCall):
        with no_autocast(hidden.device.type):
            loss, logprob, entropy, grads = call.run(
                hidden, weight, bias, targets, row_mask, inv_t, call
            )
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.present = tuple(g is not None for g in grads)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.used = False
        outs = (logprob,) if entropy is None else (logprob, entropy)
        ctx.mark_non_differentiable(*outs)
        return (loss, *outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss, *_unused):
        if ctx.used:
            raise RuntimeError(
                "fused_linear_loss: backward ran twice on one forward (retain_graph); its "
                "gradients were formed in forward and are handed out once"
            )
        ctx.used = True
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if here else None for here in ctx.present]
        out = []
        for grad, dtype in zip(grads, ctx.dtypes, strict=True):
            if grad is None:
                out.append(None)
                continue
            # Scaled in place (the buffers are this Function's own); rounded once to the input's
            # dtype (the weight gradient is kept in the compute dtype until here).
            grad.mul_(grad_loss.to(grad.dtype))
            out.append(grad if grad.dtype == dtype else grad.to(dtype))
        return (*out, None, None, None, None)


def _run(hidden, weight, bias, targets, row_mask, inv_t, call: _LossCall):
    """The forward: per row group, kernel forward, ``loss_fn``, kernel backward on kept tiles."""
    need_h, need_w, need_b = call.need
    need_b = need_b and bias is not None
    cdtype = head_dtype(hidden, weight, bias)
    # The weight gradient is accumulated in the compute dtype, rounded once in backward.
    logprob, entropy, grad_h, grad_w, grad_b = _loss_buffers(hidden, weight, bias, call, cdtype)
    any_grad = need_h or need_w or need_b
    losses = []
    for start, end, mask, inv in _row_groups(call, row_mask, inv_t):
        rows = slice(start, end)
        h, t = hidden[rows], targets[rows]
        plan = _group_plan(call.plan, end - start, any_grad)
        out, saved = _forward(h, weight, bias, t, None, mask, inv, plan)
        lp, ent = out if plan.spec.with_entropy else (out, None)
        g_lp, g_ent = _record_group(call, start, end, (lp, ent), (logprob, entropy), losses)
        if _no_gradient(any_grad, g_lp, g_ent, grad_h, rows):
            continue
        gh, _, gb = _backward(
            (h, weight, bias, t, None, mask, inv, *saved),
            (len(saved) - 3) // 2,
            plan,
            (need_h, need_w, need_b),
            g_lp,
            g_ent,
            grad_w_acc=grad_w,
        )
        del saved
        if need_h:
            grad_h[rows] = gh
        if need_b:
            grad_b += gb.to(cdtype)
    return _total(losses, hidden, cdtype), logprob, entropy, (grad_h, grad_w, grad_b)


def _loss_buffers(hidden, weight, bias, call: _LossCall, cdtype, grad_w_dtype=None):
    """A fused loss forward's outputs, written group by group: ``(logprob [N], entropy [N] or
    None, grad_h [N, H] or None, grad_w [V, H] or None, grad_b [V] or None)``, a gradient only
    where ``call.need`` asks for it. The log-probs, entropy and bias gradient are in ``cdtype``,
    ``grad_w`` in ``grad_w_dtype`` (default ``cdtype``); the weight and bias gradients are zeros,
    since the groups add to them (a vocab-parallel shard's padding rows stay 0)."""
    need_h, need_w, need_b = call.need
    n = hidden.shape[0]
    logprob = hidden.new_empty(n, dtype=cdtype)
    entropy = hidden.new_empty(n, dtype=cdtype) if call.plan.spec.with_entropy else None
    grad_h = hidden.new_empty(hidden.shape) if need_h else None
    grad_w = weight.new_zeros(weight.shape, dtype=grad_w_dtype or cdtype) if need_w else None
    grad_b = bias.new_zeros(bias.shape, dtype=cdtype) if need_b and bias is not None else None
    return logprob, entropy, grad_h, grad_w, grad_b


def _row_groups(call: _LossCall, row_mask, inv_t):
    """``(start, end, mask, inv)`` per row group of ``call``: its rows' slices of ``row_mask``
    and of the per-row inverse temperatures ``inv_t`` (each None when the call has none)."""
    for start, end in call.groups:
        mask = None if row_mask is None else row_mask[start:end]
        inv = None if inv_t is None else inv_t[start:end]
        yield start, end, mask, inv


def _no_gradient(any_grad: bool, g_lp, g_ent, grad_h, rows: slice) -> bool:
    """Whether a group has no backward to run: no input needs a gradient, or the loss does not
    depend on its rows (their hidden gradient is then 0)."""
    if not any_grad:
        return True
    if g_lp is None and g_ent is None:
        if grad_h is not None:
            grad_h[rows] = 0.0
        return True
    return False


def _total(losses: list, hidden: torch.Tensor, cdtype) -> torch.Tensor:
    """The sum of the groups' losses (a 0-d tensor in ``cdtype`` with no group)."""
    return torch.stack(losses).sum() if losses else hidden.new_zeros((), dtype=cdtype)


def _record_group(call: _LossCall, start: int, end: int, values, outputs, losses: list):
    """Store a group's ``(log-probs, entropy)`` into the ``outputs`` buffers, run its loss (kept
    in ``losses``) and return the upstream gradients (None where the loss does not use them)."""
    (lp, ent), (logprob, entropy) = values, outputs
    logprob[start:end] = lp
    if ent is not None:
        entropy[start:end] = ent
    loss, g_lp, g_ent = _group_loss(call, start, end, lp, ent)
    losses.append(loss)
    return g_lp, g_ent


def _group_loss(call: _LossCall, start: int, end: int, lp: torch.Tensor, ent: torch.Tensor | None):
    """The caller's loss on detached leaves; its value and the upstream gradients (None when
    the loss does not depend on them)."""
    leaves = [lp.detach().requires_grad_()]
    if ent is not None:
        leaves.append(ent.detach().requires_grad_())
    with torch.enable_grad():
        loss, aux = call.loss_fn(start, end, leaves[0], leaves[1] if ent is not None else None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                "fused_linear_loss: loss_fn must return (0-d tensor, aux), got loss "
                f"{getattr(loss, 'shape', type(loss))}"
            )
        call.aux.append(aux)
        if not loss.requires_grad:
            return loss.detach(), None, None
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    g_lp = grads[0]
    g_ent = grads[1] if ent is not None else None
    return loss.detach(), g_lp, g_ent


def _group_plan(plan, rows: int, any_grad: bool):
    """The kernel plan of one group of ``rows`` rows: one chunk of all of them when they fit
    (``plan.rows`` is the tallest that does), else equal chunks; kept tiles within the budget."""
    height = rows if rows <= plan.rows else -(-rows // -(-rows // plan.rows))
    tiles_per_chunk = -(-plan.vocab // plan.vocab_tile)
    count = -(-rows // height) * tiles_per_chunk
    kept = 0
    if any_grad:
        working = 3 if plan.spec.softcap is not None and plan.spec.with_entropy else 2
        kept = min(count, max(0, _budget() // (height * plan.vocab_tile) - working))
    return replace(plan, rows=height, kept_tiles=kept)


def _budget() -> int:
    """Compute-dtype elements of the tile buffers: the fused kernel's cap (four full tiles)."""
    return _BUFFER_TILES * WORKING_TILE_ELEMENTS


@dataclass(frozen=True)
class _GroupPlan(_Plan):
    """``linear_logprob._Plan`` plus the vocabulary size, for the plans of the groups."""

    vocab: int = 0


def _loss_plan(base: _Plan, vocab: int) -> _GroupPlan:
    """``base`` with the rows of the tallest group: its kept tiles and the gradient pass's
    working tiles fit the budget."""
    tiles = -(-vocab // base.vocab_tile)
    working = 3 if base.spec.softcap is not None and base.spec.with_entropy else 2
    configured = base.spec.chunk_size or 1024
    rows = max(1, min(configured, _budget() // (base.vocab_tile * (tiles + working))))
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    return _GroupPlan(**{**values, "rows": rows}, vocab=vocab)


def _groups(segments: Sequence[int], rows: int) -> tuple[tuple[int, int], ...]:
    """Consecutive segments merged greedily while the group has at most ``rows`` rows (a longer
    segment is a group on its own)."""
    if len(segments) == segments[-1] - segments[0] + 1:  # every row a segment: chunks of rows
        return tuple(
            (s, min(s + rows, segments[-1])) for s in range(segments[0], segments[-1], rows)
        )
    groups, start = [], segments[0]
    for prev, end in itertools.pairwise(segments):
        if end - start > rows and prev > start:
            groups.append((start, prev))
            start = prev
    if segments[-1] > start:
        groups.append((start, segments[-1]))
    return tuple(groups)


def _check_segments(segments, n: int) -> Sequence[int]:
    if segments is None:  # every row a segment (a range: no list of N ints to build)
        return range(n + 1)
    if isinstance(segments, torch.Tensor) or not isinstance(segments, Sequence):
        raise ValueError("segments must be a sequence of Python ints (row boundaries) or None")
    bounds = list(segments)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise ValueError("segments must hold Python ints")
    if not bounds or bounds[0] != 0 or bounds[-1] != n:
        raise ValueError(f"segments must start at 0 and end at the row count {n}, got {bounds[:3]}")
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError("segments must be strictly increasing")
    return bounds


def fused_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: GroupLossFn,
    *,
    segments: Sequence[int] | None = None,
    **head: Unpack[HeadOptions],
) -> FusedLossOutput:
    """A loss of the lm-head's log-probs (and entropy), with its gradients formed in forward.

    Equivalent to ``lp, ent = fused_linear_logprob(hidden, weight, targets, ...)`` followed by
    ``sum(loss_fn(s, e, lp.flatten()[s:e], ent.flatten()[s:e])[0] for each group [s, e))`` and
    its backward, to the rounding of the compute dtype, but without recomputing any logits tile
    in backward: 4·N·H·V flops with a frozen weight, 6·N·H·V with a trainable one
    (``docs/kernels.md``, "The fused loss path").

    Args:
        hidden, weight, targets, temperature, chunk_size, ignore_index, validate, bias,
        logit_scale, softcap, implementation: as in :func:`microrl.kernels.fused_linear_logprob`
            (same checks and errors). ``chunk_size`` caps the rows of a group.
        loss_fn: ``loss_fn(start, end, logprobs, entropy) -> (loss, aux)``, called once per group
            of flattened rows ``[start, end)`` (consecutive, covering all rows in order), inside
            this function's forward with autograd enabled, on detached leaves ``[end - start]``
            (``entropy`` None without ``with_entropy``; ignored positions hold 0). ``loss`` is
            the group's partial loss, a 0-d tensor whose gradient may flow only to those leaves
            (the group losses are summed); ``aux`` is collected in the output.
        segments: boundaries of the flattened rows that a group never splits, Python ints from 0
            to N (e.g. sequence starts: a per-sequence loss sees whole sequences); None lets a
            group end at any row.
        with_entropy: compute the entropy (``loss_fn`` gets it; off by default).

    Returns:
        :class:`FusedLossOutput` (``loss`` with gradients; ``logprobs``/``entropy`` detached).

    Raises:
        TypeError, ValueError: as ``fused_linear_logprob``; ``loss_fn`` not callable, bad
        ``segments``; a ``loss_fn`` that does not return a 0-d tensor (TypeError).
    """
    spec, temperature, bias = head_spec("fused_linear_loss", head, with_entropy=False)
    spec, inputs = checked_inputs(hidden, weight, targets, temperature, bias, spec)
    return run_loss(inputs, targets.shape, loss_fn, segments, spec, "fused_linear_loss")


def run_loss(
    inputs: HeadInputs, shape: torch.Size, loss_fn: GroupLossFn, segments, spec: HeadSpec,
    what: str, *, shard: VocabShard | None = None, tiles_run: Callable = _run,
) -> FusedLossOutput:  # fmt: skip
    """A fused loss past its input checks (``what``: the public function's name): the groups, the
    implementation and its plan, the Function. ``shard``: this rank's columns of a vocab-parallel
    loss, whose tiles path is ``tiles_run`` (``vocab_parallel_loss._run_sharded``)."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    hidden, weight, bias, need = inputs.hidden, inputs.weight, inputs.bias, inputs.need
    n = inputs.targets.numel()
    bounds = _check_segments(segments, n)
    spec = resolve(hidden, weight, bias, spec, what)
    vocab = weight.shape[0] if shard is None else max(1, shard.real_rows)  # padding only: 1 row
    row_mask = inputs.valid
    if spec.implementation == "tiles":
        native16 = shard is None and _native16(hidden, weight, bias)
        base = _plan(max(1, n), vocab, spec, (True, True), native16, weight.shape[1])
        plan, run = _loss_plan(base, vocab), tiles_run
    else:
        masked = inputs.count != n  # validate=False, or some row ignored; else blocks are views
        plan = loss_plan(
            hidden, weight, bias, max(1, n), need, spec, vocab=vocab, row_copies=masked
        )
        run, row_mask = partial(run_chunked, shard), inputs.valid if masked else None
    call = _LossCall(_groups(bounds, plan.rows), plan, need, loss_fn, run)
    out = _FusedLinearLoss.apply(
        hidden, weight, bias, inputs.targets, row_mask, inputs.masked_inv_t(), call
    )
    entropy = out[2].view(shape) if spec.with_entropy else None
    return FusedLossOutput(out[0], out[1].view(shape), entropy, call.aux)
