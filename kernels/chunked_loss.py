"""The fused losses on the chunked (GPU) path: ``fused_linear_loss`` and
``vocab_parallel_linear_loss`` with the tiles of ``kernels/chunked.py``.

Per row group, as on the tiles path (``kernels/fused_loss.py``): the group's row statistics, the
caller's loss on its log-probs (its upstream gradients by autograd on ``[rows]`` leaves), then
the gradient pass with those. Two ways to run a group, the one the roofline model
(``kernels/_chunk_plan.py``) predicts faster for the call is taken:

* **kept**: the group's whole ``[rows, V]`` float32 logits in one tile, kept from the statistics
  kernel to the gradient kernel, so the group costs three GEMMs (logits, hidden and weight
  gradients); groups are then at most as tall as such a tile fits the budget;
* **recomputed**: the group in the plan's tiles, each recomputed in the gradient pass (four
  GEMMs), for groups of any height; wins where the kept tile's few rows would make the weight
  GEMMs bandwidth-bound (a large vocabulary in a small budget).

A segment longer than a kept tile is recomputed whatever the mode. The weight (and bias)
gradient is accumulated over the groups in the weight's dtype (a 16-bit weight gradient is
rounded once per group: docs/kernels.md, "How the CUDA path is built").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist

from . import _chunk_plan, _dispatch
from ._checks import HeadSpec, head_dtype
from ._tiles import _zero_unkept
from .chunked import (
    Head,
    VocabShard,
    finalize,
    gemm_sizes,
    grad_pass,
    make_head,
    stats_pass,
    upstream,
)

__all__ = [
    "LOSS_BUDGET_FACTOR",
    "LossPlan",
    "head_budget_bytes",
    "loss_plan",
    "run_chunked",
]

#: The fused losses' tile budget, in units of the plain kernel's (``_chunk_plan.budget_bytes``).
#: Kept tiles hold whole rows, and at a 150k vocabulary a kept tile of the plain budget has too
#: few rows for its weight-gradient GEMM to be compute-bound (it reads and writes the whole
#: ``[V, H]`` gradient per tile); twice that reaches it on an H200 (docs/kernels.md).
LOSS_BUDGET_FACTOR = 2


def head_budget_bytes(
    tokens: int, vocab: int, hidden_size: int, *, fused_loss: bool = False
) -> int:
    """Bytes the fused head's GPU path may use beyond its inputs, outputs and gradients, for
    ``tokens`` rows of a ``vocab x hidden_size`` head: its tile budget (about ``3.5 * tokens *
    hidden_size``, at least 8 MiB; the fused losses twice it). docs/kernels.md, "Memory and
    chunk_size"."""
    budget = _chunk_plan.budget_bytes(max(1, tokens), max(1, vocab), max(1, hidden_size))
    return budget * (LOSS_BUDGET_FACTOR if fused_loss else 1)


@dataclass(frozen=True)
class LossPlan:
    """How a fused-loss call runs its groups: the Head of the call (its plan is the recomputed
    mode's, for the whole call), whether groups keep their tile, and the tallest kept tile."""

    head: Head
    keep: bool
    keep_rows: int  # the tallest group whose [rows, V] tile fits the budget (0: none)
    problem: _chunk_plan.Problem  # the whole call's
    budget: int

    @property
    def rows(self) -> int:
        """The height of a group (``kernels/fused_loss._groups``)."""
        return self.keep_rows if self.keep else self.head.plan.rows

    @property
    def spec(self) -> HeadSpec:
        return self.head.spec

    def head_for(self, rows: int, vocab: int, hidden_size: int) -> tuple[Head, bool]:
        """The Head of a group of ``rows`` rows, and whether it keeps its tile."""
        temps = self.head.plan.temps
        if self.keep and rows <= self.keep_rows:
            return replace(self.head, plan=_chunk_plan.ChunkPlan(rows, vocab, temps)), True
        problem = replace(self.problem, m=rows, v=vocab, h=hidden_size)
        plan = _chunk_plan.plan_tiles(
            problem, budget=self.budget, chunk_size=self.spec.chunk_size, temps=temps
        )
        return replace(self.head, plan=plan), False


def _keep_rows(problem: _chunk_plan.Problem, budget: int, chunk_size, temps: int) -> int:
    """The most rows whose whole ``[rows, vocab]`` tile (and the rest of the memory model) fits
    ``budget``: the model is linear in the rows."""
    tallest = min(problem.m, chunk_size or problem.m)

    def model(rows):
        return _chunk_plan.extra_bytes(problem, _chunk_plan.ChunkPlan(rows, problem.v, temps))

    fixed = model(0)
    per_row = model(1) - fixed
    return max(0, min(tallest, (budget - fixed) // per_row if budget > fixed else 0))


def loss_plan(
    hidden, weight, bias, count: int, need, spec: HeadSpec, *, vocab: int | None = None,
    row_copies: bool = True,
) -> LossPlan:  # fmt: skip
    """The LossPlan of a call with ``count`` rows over ``vocab`` columns (default: the weight's
    rows): kept or recomputed groups, whichever :func:`_chunk_plan.plan_seconds` predicts faster."""
    vocab = weight.shape[0] if vocab is None else vocab
    need = tuple(need)
    hidden_size = weight.shape[1]
    budget = head_budget_bytes(count, vocab, hidden_size, fused_loss=True)
    head = make_head(
        hidden, weight, bias, count, need, spec, row_copies=row_copies, vocab=vocab, budget=budget
    )
    sizes = gemm_sizes(hidden, weight, head_dtype(hidden, weight, bias), head.gemm16)
    problem = _chunk_plan.Problem(
        count, vocab, hidden_size, sizes, need, bias is not None, row_copies
    )
    temps = _dispatch.row_ops(spec.implementation).TEMPS
    keep_rows = _keep_rows(problem, budget, spec.chunk_size, temps)
    recomputed = _chunk_plan.plan_seconds(problem, head.plan)
    kept = float("inf")
    if keep_rows > 0:
        plan = _chunk_plan.ChunkPlan(keep_rows, vocab, temps)
        kept = _chunk_plan.plan_seconds(problem, plan, keep=True)
    return LossPlan(head, kept < recomputed, keep_rows, problem, budget)


def run_chunked(shard: VocabShard | None, hidden, weight, bias, targets, row_mask, inv_t, call):
    """``fused_loss._run`` on the chunked path (the module docstring): per group the
    statistics, ``loss_fn``, the gradient pass. ``shard``: this rank's columns (vocab-parallel),
    or None; ``row_mask``: the non-ignored rows, or None when every row is."""
    from .fused_loss import _loss_buffers, _no_gradient, _record_group, _row_groups, _total

    plan: LossPlan = call.plan
    need_h, need_w, need_b = call.need
    need_b = need_b and bias is not None
    cdtype = head_dtype(hidden, weight, bias)
    hidden_size = hidden.shape[1]
    real = weight.shape[0] if shard is None else shard.real_rows
    local_w = weight[:real]
    local_b = None if bias is None else bias[:real].to(cdtype)
    local_t = targets if shard is None else targets - shard.vocab_start
    # The weight gradient is summed over the groups in the weight's dtype.
    outputs = _loss_buffers(hidden, weight, bias, call, cdtype, weight.dtype)
    logprob, entropy, grad_h, grad_w, grad_b = outputs
    any_grad = need_h or need_w or need_b
    losses = []
    for start, end, mask, inv in _row_groups(call, row_mask, inv_t):
        rows = slice(start, end)
        h, t = hidden[rows], local_t[rows]
        head, keep = plan.head_for(end - start, max(1, real), hidden_size)
        local, kept = stats_pass(head, h, local_w, local_b, t, None, mask, inv, keep=keep)
        m, lp, ent_all, log_s = finalize(local, t, shard)
        values = (_zero_unkept(lp, mask), None if ent_all is None else _zero_unkept(ent_all, mask))
        g_lp, g_ent = _record_group(call, start, end, values, (logprob, entropy), losses)
        if _no_gradient(any_grad, g_lp, g_ent, grad_h, rows):
            continue
        g_lp = upstream(g_lp, end - start, hidden, cdtype, mask, None)
        if plan.spec.with_entropy:
            g_ent = upstream(g_ent, end - start, hidden, cdtype, mask, None)
        gh = None
        if need_h:  # vocab-parallel: the shard's partial sum, summed over the group first
            gh = grad_h[rows] if shard is None else h.new_zeros(h.shape, dtype=cdtype)
        grad_pass(
            head, (need_h, need_w, need_b), h, local_w, local_b, t, None, mask, inv, m, log_s,
            ent_all, g_lp, g_ent, gh, None if grad_w is None else grad_w[:real],
            None if grad_b is None else grad_b[:real], accumulate_w=True, kept=kept,
        )  # fmt: skip
        del kept
        if need_h and shard is not None:
            if shard.group is not None:
                dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=shard.group)
            grad_h[rows] = gh
    return _total(losses, hidden, cdtype), logprob, entropy, (grad_h, grad_w, grad_b)
