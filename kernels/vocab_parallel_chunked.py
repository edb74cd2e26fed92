"""``vocab_parallel_linear_logprob`` on the chunked (GPU) path: each rank runs the chunked
statistics pass (``kernels/chunked.py``) over its shard's real columns, the ranks combine them
exactly with the two all-reduces of ``kernels/vocab_parallel.py`` (``_combine``), and backward
runs the chunked gradient pass on the shard with the global statistics (``exp(z - m) / S`` of a
local logit is its probability under the whole vocabulary), then sums the hidden gradient's
partial sums over the group. Contract and math: docs/kernels.md, "Vocab-parallel".
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ._checks import HeadInputs, HeadSpec, head_dtype, no_autocast
from .chunked import Head, grad_pass, make_head, scatter_rows, stats_pass, upstream
from .chunked_loss import VocabShard, combine, shard_hidden_grad

__all__ = ["vocab_parallel_chunked"]


class _VocabParallelChunked(torch.autograd.Function):
    # Never ctx.set_materialize_grads(False): an unused output's gradient must arrive as zeros.
    @staticmethod
    def forward(
        ctx: FunctionCtx, hidden, weight, bias, targets, rows_idx, row_mask, inv_t,
        shard: VocabShard, head: Head,
    ):  # fmt: skip
        # As vocab_parallel._VocabParallelLinearLogProb: hidden [N, H] replicated, weight this
        # rank's [V_local, H] shard, bias its [V_local] or None, targets [N] global ids.
        cdtype = head_dtype(hidden, weight, bias)
        real = shard.real_rows
        with no_autocast(hidden.device.type):
            local_t = targets - shard.vocab_start
            bias_c = None if bias is None else bias[:real].to(cdtype)
            local, _ = stats_pass(
                head, hidden, weight[:real], bias_c, local_t, rows_idx, row_mask, inv_t
            )
            t_proc = local_t if rows_idx is None else local_t.index_select(0, rows_idx)
            m, s, a, shifted = combine(local, t_proc, shard)
            log_s = s.log()
            logprob = shifted - log_s  # (z_t - m) - log S, as finalize
            entropy = None if a is None else log_s - a / s
            n = hidden.shape[0]
            outs = [scatter_rows(logprob, n, rows_idx, row_mask)]
            if head.spec.with_entropy:
                outs.append(scatter_rows(entropy, n, rows_idx, row_mask))
        ctx.save_for_backward(
            hidden, weight, bias, local_t, rows_idx, row_mask, inv_t, m, log_s, entropy
        )
        ctx.shard, ctx.head = shard, head
        return tuple(outs) if head.spec.with_entropy else outs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprob, grad_entropy=None):
        hidden, weight, bias, local_t, rows_idx, row_mask, inv_t, m, log_s, ent = ctx.saved_tensors
        shard: VocabShard = ctx.shard
        head: Head = ctx.head
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        cdtype, real, n = m.dtype, shard.real_rows, hidden.shape[0]
        with no_autocast(hidden.device.type):
            g_lp = upstream(grad_logprob, n, hidden, cdtype, row_mask, rows_idx)
            g_ent = None
            if head.spec.with_entropy:
                g_ent = upstream(grad_entropy, n, hidden, cdtype, row_mask, rows_idx)
            # The shard's partial sum G_local @ W_local per processed row, summed over the group.
            gh = hidden.new_zeros((m.numel(), hidden.shape[1]), dtype=cdtype) if need_h else None
            grad_w = weight.new_zeros(weight.shape) if need_w else None  # padding rows: 0
            grad_b = bias.new_zeros(bias.shape, dtype=cdtype) if need_b else None
            grad_pass(
                head, (need_h, need_w, need_b), hidden, weight[:real],
                None if bias is None else bias[:real].to(cdtype), local_t, rows_idx, row_mask,
                inv_t, m, log_s, ent, g_lp, g_ent, gh, None if grad_w is None else grad_w[:real],
                None if grad_b is None else grad_b[:real], put_original=False,
            )  # fmt: skip
        grad_h = shard_hidden_grad(gh, hidden, rows_idx, shard.group) if need_h else None
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def vocab_parallel_chunked(inputs: HeadInputs, shard: VocabShard, spec: HeadSpec):
    """``vocab_parallel_linear_logprob`` on the chunked path, from its checked inputs (the
    shard's weight and bias). Returns the Function's output."""
    hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
    rows_idx, row_mask, inv_t = inputs.rows()
    count = hidden.shape[0] if rows_idx is None else rows_idx.numel()
    head = make_head(
        hidden, weight, bias, count, inputs.need, spec, vocab=max(1, shard.real_rows),
        row_copies=rows_idx is not None or row_mask is not None,
    )  # fmt: skip
    return _VocabParallelChunked.apply(
        hidden, weight, bias, inputs.targets, rows_idx, row_mask, inv_t, shard, head
    )
