"""The chunked lm head: the CUDA path of ``fused_linear_logprob`` (implementations ``"triton"``
and ``"chunks"``, ``kernels/_dispatch.py``).

Tiles of ``rows x cols`` float32 logits, sized by the plan (``kernels/_chunk_plan.py``): per
tile one GEMM into the float32 tile (16-bit inputs multiply with float32 accumulation and
output: the logits are never rounded to 16 bits) and one row kernel that reads it once and
merges the rows' softmax statistics. Only O(N) statistics are kept for backward, which per tile
recomputes the GEMM, forms the logit gradient in place (in the GEMM dtype) and runs the hidden-
and weight-gradient GEMMs. The passes here serve the plain kernel and the vocab-parallel one
(this module's Function, with a :class:`VocabShard` for the latter: its statistics combined over
the group) and the fused losses (``kernels/chunked_loss.py``). Contract: docs/kernels.md; how:
its "How the CUDA path is built".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from . import _chunk_plan, _dispatch
from ._checks import HeadInputs, HeadSpec, head_dtype, no_autocast
from ._tiles import _masked_rows, _or_zeros, _row_factors, _take, _zero_unkept

__all__ = [
    "Head",
    "RowStats",
    "VocabShard",
    "chunked_linear_logprob",
    "combine",
    "finalize",
    "grad_pass",
    "make_head",
    "scatter_rows",
    "shard_hidden_grad",
    "stats_pass",
    "upstream",
]

_HALF = (torch.float16, torch.bfloat16)
# (device type, dtype) -> whether torch.mm / torch.addmm take out_dtype=float32 there.
_NATIVE_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


@dataclass(frozen=True)
class Head:
    """What every pass needs besides the tensors: the call's checked ``HeadSpec`` (its
    ``implementation`` is ``"triton"`` or ``"chunks"``: which row kernels) and its tile plan,
    bundled so backward returns few Nones."""

    plan: _chunk_plan.ChunkPlan
    spec: HeadSpec
    gemm16: bool = False  # GEMMs on the 16-bit inputs, float32 output; else in the compute dtype


@dataclass
class RowStats:
    """Per processed row: max ``m``, ``s = sum exp(z - m)``, ``a = sum exp(z - m) (z - m)``
    (None without entropy) and the target's final logit ``zt`` (0 where not in the columns)."""

    m: torch.Tensor
    s: torch.Tensor
    a: torch.Tensor | None
    zt: torch.Tensor


def _native_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether 16-bit GEMMs can write float32 themselves here (probed once per device type and
    dtype; a CPU has no such kernel, so its GEMMs are emulated on upcast copies)."""
    key = (device.type, dtype)
    if key not in _NATIVE_OUT_DTYPE:
        supported = device.type != "cpu"
        if supported:
            probe = torch.ones(1, 1, dtype=dtype, device=device)
            out = torch.zeros(1, 1, device=device)
            try:
                torch.addmm(out, probe, probe, out_dtype=torch.float32, out=out)
            except (RuntimeError, TypeError, NotImplementedError):
                supported = False
        _NATIVE_OUT_DTYPE[key] = supported
    return _NATIVE_OUT_DTYPE[key]


def _gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b``, accumulated in ``out``'s dtype or wider: 16-bit operands into a
    float32 ``out`` natively (``out_dtype``) or on upcast copies; a wider product into a
    narrower ``out`` through a temporary."""
    if a.dtype != out.dtype and out.dtype.itemsize > a.dtype.itemsize:
        if a.dtype in _HALF and _native_out_dtype(a.device, a.dtype):
            if accumulate:
                torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            else:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
            return
        a, b = a.to(out.dtype), b.to(out.dtype)
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    product = torch.mm(a, b)  # float32 operands, a 16-bit gradient: one rounding per call
    out.add_(product) if accumulate else out.copy_(product)


def _view16(tile: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 16-bit ``[r, c]`` view of a contiguous float32 ``[r, c]`` tile whose row ``i`` starts at
    the byte where the tile's row ``i`` does (row stride ``2c``): the gradient kernel writes it
    over the values it has read (``kernels/_triton_rows.py``)."""
    r, c = tile.shape
    return tile.view(dtype).view(r, 2 * c)[:, :c]


def _operand(t: torch.Tensor, head: Head, cdtype: torch.dtype) -> torch.Tensor:
    return t if head.gemm16 else t.to(cdtype)


def _block(hidden, targets, inv_t, row_mask, rows_idx, rows: slice, head: Head):
    """One row block: ``(idx, real, h, inv, t)``: its row indices (None for a view), non-ignored
    mask (None: all real), hidden rows (ignored ones zeroed), inverse temperature and targets."""
    idx = None if rows_idx is None else rows_idx[rows]
    real = None if row_mask is None else _take(row_mask, rows, idx)
    h = _masked_rows(_take(hidden, rows, idx), real)
    inv = _take(inv_t, rows, idx) if inv_t is not None else head.spec.inv_temperature
    return idx, real, h, inv, _take(targets, rows, idx)


def _blocks(count: int, rows: int):
    return (slice(start, min(start + rows, count)) for start in range(0, count, rows))


def new_stats(like: torch.Tensor, count: int, dtype: torch.dtype, with_entropy: bool) -> RowStats:
    """Statistics of no column yet: ``m = -inf``, zero sums and target logits."""
    return RowStats(
        like.new_full((count,), float("-inf"), dtype=dtype),
        like.new_zeros(count, dtype=dtype),
        like.new_zeros(count, dtype=dtype) if with_entropy else None,
        like.new_zeros(count, dtype=dtype),
    )


def stats_pass(
    head: Head, hidden, weight, bias_c, targets, rows_idx, row_mask, inv_t, *, keep: bool = False
):
    """The row statistics over the columns of ``weight`` (``[v, H]``, its rows; ``targets`` are
    ids of those columns, others match none) of the processed rows (``rows_idx``, or all).

    Returns ``(RowStats, kept)``: ``kept`` is the float32 logits tile itself when ``keep`` and
    one tile covers every row and column (the fused loss then skips the backward GEMM), else
    None."""
    cdtype = head_dtype(hidden, weight, bias_c)
    count = hidden.shape[0] if rows_idx is None else rows_idx.numel()
    vocab = weight.shape[0]
    stats = new_stats(hidden, count, cdtype, head.spec.with_entropy)
    if count == 0 or vocab == 0:
        return stats, None
    rows, cols = min(head.plan.rows, count), min(head.plan.cols, vocab)
    buf = hidden.new_empty(rows * cols, dtype=cdtype)
    ops, spec = _dispatch.row_ops(head.spec.implementation), head.spec
    for blk in _blocks(count, rows):
        _, _, h, inv, t = _block(hidden, targets, inv_t, row_mask, rows_idx, blk, head)
        h_mm = _operand(h, head, cdtype)
        a = None if stats.a is None else stats.a[blk]
        for j in range(0, vocab, cols):
            w = _operand(weight[j : j + cols], head, cdtype)
            tile = buf[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])
            _gemm(tile, h_mm, w.T, accumulate=False)
            b = None if bias_c is None else bias_c[j : j + cols]
            ops.stats(tile, j, t, inv, b, spec.logit_scale, spec.softcap, stats.m[blk],
                      stats.s[blk], a, stats.zt[blk], j == 0)  # fmt: skip
        del h, h_mm  # a gathered or masked copy: gone before the next block's
    single = rows == count and cols == vocab
    return stats, (buf.view(rows, cols) if keep and single else None)


def _coefficients(head: Head, inv, g_lp, g_ent, ent, log_s):
    """The per-row factors of the gradient kernel (``_row_ops.grads``): ``(g_t, cc, bb)``."""
    spec = head.spec
    _, _, k = _row_factors(inv, spec.logit_scale, spec.softcap)  # d final logit / d z, but the cap
    g_t = g_lp * k  # a tensor: the kernels read one value per row
    if g_ent is None:
        return g_t, g_t, None
    return g_t, (g_lp + g_ent * (ent - log_s)) * k, g_ent * k


def grad_pass(
    head: Head,
    need: tuple[bool, bool, bool],
    hidden, weight, bias_c, targets, rows_idx, row_mask, inv_t,
    m, log_s, ent, g_lp, g_ent,
    grad_h, grad_w, grad_b,
    *,
    put_original: bool = True,
    accumulate_w: bool = False,
    kept: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Backward over the tiles, writing the gradients in place.

    ``m``, ``log_s``, ``ent``: the rows' statistics over the whole vocabulary (``ent`` None
    without entropy); ``g_lp``, ``g_ent``: upstream gradients of the processed rows (zero on
    ignored ones; ``g_ent`` None without entropy). ``grad_h``: the hidden gradient, rows in the
    original order (``put_original``) or in processed order; ``grad_w`` (``[v, H]``) is written
    (``accumulate_w``: added to) and ``grad_b`` (compute dtype) added to. ``need`` says which of
    the three to form. ``kept``: the tile ``stats_pass`` kept (no GEMM again)."""
    need_h, need_w, need_b = need
    cdtype = m.dtype
    count, vocab = m.numel(), weight.shape[0]
    if count == 0 or vocab == 0 or not (need_h or need_w or need_b):
        return
    rows, cols = min(head.plan.rows, count), min(head.plan.cols, vocab)
    buf = kept.view(-1) if kept is not None else hidden.new_empty(rows * cols, dtype=cdtype)
    in_place = grad_h is not None and grad_h.dtype == cdtype
    in_place = in_place and (rows_idx is None or not put_original)
    acc = None
    if need_h and cols < vocab and not in_place:  # the block's gradient over the slices
        acc = hidden.new_empty(rows, hidden.shape[1], dtype=cdtype)
    ops, spec = _dispatch.row_ops(head.spec.implementation), head.spec
    # The per-row factors of every processed row at once: a few ops per call, not per block.
    inv_all = spec.inv_temperature
    if inv_t is not None:
        inv_all = inv_t if rows_idx is None else inv_t.index_select(0, rows_idx)
    coefs = _coefficients(head, inv_all, g_lp, g_ent, ent, log_s)
    for blk in _blocks(count, rows):
        idx, _, h, inv, t = _block(hidden, targets, inv_t, row_mask, rows_idx, blk, head)
        put_idx = idx if put_original else None
        h_mm = _operand(h, head, cdtype)
        coef = tuple(None if c is None else c[blk] for c in coefs)
        dest = grad_h[blk] if need_h and put_idx is None else None
        target = dest if acc is None and cols < vocab else acc
        for j in range(0, vocab, cols):
            w = _operand(weight[j : j + cols], head, cdtype)
            r, c = h.shape[0], w.shape[0]
            tile = buf[: r * c].view(r, c)
            if kept is None:
                _gemm(tile, h_mm, w.T, accumulate=False)
            dz = _view16(tile, hidden.dtype) if head.gemm16 else tile
            b = None if bias_c is None else bias_c[j : j + cols]
            ops.grads(
                tile, dz, j, t, inv, b, spec.logit_scale, spec.softcap, m[blk], log_s[blk], *coef
            )
            if need_b:
                grad_b[j : j + c] += dz.sum(0, dtype=cdtype)
            if need_h and c == vocab:  # one slice: straight into the gradient's rows
                _put_rows(grad_h, blk, put_idx, dz, w, dest)
            elif need_h:
                _gemm(target[:r], dz, w, accumulate=j > 0)
            if need_w:
                _gemm(grad_w[j : j + c], dz.T, h_mm, accumulate=accumulate_w or blk.start > 0)
        if need_h and cols < vocab and target is acc:
            _put(grad_h, blk, put_idx, acc[: h.shape[0]])
        del h, h_mm  # a gathered or masked copy: gone before the next block's


def _put(out: torch.Tensor, rows: slice, idx, values: torch.Tensor) -> None:
    if idx is None:
        out[rows] = values
    else:
        out.index_copy_(0, idx, values.to(out.dtype))


def _put_rows(grad_h, rows: slice, idx, dz, w, dest) -> None:
    """``dz @ w`` into the hidden gradient's rows ``rows`` (a view) or ``idx`` (gathered)."""
    if dest is not None:
        _gemm(dest, dz, w, accumulate=False)
        return
    block = grad_h.new_empty((dz.shape[0], grad_h.shape[1]))
    _gemm(block, dz, w, accumulate=False)
    grad_h.index_copy_(0, idx, block)


@dataclass(frozen=True)
class VocabShard:
    """A vocab-parallel rank's columns: its group, first global id and real (unpadded) rows."""

    group: dist.ProcessGroup | None
    vocab_start: int
    real_rows: int


def combine(local, targets_local, shard: VocabShard | None):
    """``(m, s, a, zt - m)`` over the whole vocabulary (vocab-parallel: the exact all-reduces of
    ``vocab_parallel._combine``)."""
    if shard is None:
        return local.m, local.s, local.a, local.zt - local.m
    from . import vocab_parallel

    return vocab_parallel._combine((local.m, local.s, local.a, local.zt), targets_local, shard)


def shard_hidden_grad(gh: torch.Tensor, hidden: torch.Tensor, rows_idx, group) -> torch.Tensor:
    """The hidden gradient ``[N, H]`` in ``hidden``'s dtype from this shard's partial sums
    ``gh`` (``[M, H]``, G_local @ W_local of the processed rows, summed over ``group`` here in
    place: the group's sum is the full gradient), scattered to ``rows_idx`` (zeros elsewhere)."""
    if group is not None:
        dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
    if rows_idx is None:
        return gh.to(hidden.dtype)
    grad_h = hidden.new_zeros(hidden.shape)
    return grad_h.index_copy_(0, rows_idx, gh.to(hidden.dtype))


def finalize(local: RowStats, targets, shard: VocabShard | None):
    """``(m, logprob, entropy | None, log_s)`` of the processed rows over the whole vocabulary
    (a ``shard``'s statistics combined over its group; ``targets``: the rows' ids local to it):
    ``log p = (zt - m) - log s`` and ``H = log s - a / s``."""
    m, s, a, shifted = combine(local, targets, shard)
    log_s = s.log()
    entropy = None if a is None else log_s - a / s
    return m, shifted - log_s, entropy, log_s


def upstream(grad, count: int, like, dtype, row_mask, rows_idx):
    """An output's upstream gradient per processed row: None counts as zeros (never a dropped
    branch), ignored rows' values are dropped (NaN or not)."""
    g = _or_zeros(grad, count, like, dtype)
    if row_mask is not None:
        g = _zero_unkept(g, row_mask)
    return g if rows_idx is None else g.index_select(0, rows_idx)


class _ChunkedLinearLogProb(torch.autograd.Function):
    # Never ctx.set_materialize_grads(False): an unused output's gradient must arrive as zeros.
    @staticmethod
    def forward(
        ctx: FunctionCtx, hidden, weight, bias, targets, rows_idx, row_mask, inv_t,
        head: Head, shard: VocabShard | None,
    ):  # fmt: skip
        # As linear_logprob._FusedLinearLogProb: hidden [N, H], weight [V, H], bias [V] or None,
        # targets [N] (ignored ones 0), rows_idx [M] or None, row_mask [N] or None, inv_t [N] or
        # None. With a shard (vocab-parallel): hidden replicated, weight this rank's [V_local, H]
        # rows (past shard.real_rows: padding, never read), bias its [V_local], targets global.
        cdtype = head_dtype(hidden, weight, bias)
        real = weight.shape[0] if shard is None else shard.real_rows
        with no_autocast(hidden.device.type):
            local_t = targets if shard is None else targets - shard.vocab_start
            bias_c = None if bias is None else bias[:real].to(cdtype)
            local, _ = stats_pass(
                head, hidden, weight[:real], bias_c, local_t, rows_idx, row_mask, inv_t
            )
            t_proc = local_t
            if shard is not None and rows_idx is not None:
                t_proc = local_t.index_select(0, rows_idx)
            m, logprob, entropy, log_s = finalize(local, t_proc, shard)
            n = hidden.shape[0]
            outs = [scatter_rows(logprob, n, rows_idx, row_mask)]
            if head.spec.with_entropy:
                outs.append(scatter_rows(entropy, n, rows_idx, row_mask))
        ctx.save_for_backward(
            hidden, weight, bias, local_t, rows_idx, row_mask, inv_t, m, log_s, entropy
        )
        ctx.head, ctx.shard = head, shard
        return tuple(outs) if head.spec.with_entropy else outs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprob, grad_entropy=None):
        hidden, weight, bias, local_t, rows_idx, row_mask, inv_t, m, log_s, ent = ctx.saved_tensors
        head: Head = ctx.head
        shard: VocabShard | None = ctx.shard
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        cdtype, n = m.dtype, hidden.shape[0]
        real = weight.shape[0] if shard is None else shard.real_rows
        with no_autocast(hidden.device.type):
            g_lp = upstream(grad_logprob, n, hidden, cdtype, row_mask, rows_idx)
            g_ent = None
            if head.spec.with_entropy:
                g_ent = upstream(grad_entropy, n, hidden, cdtype, row_mask, rows_idx)
            grad_h = None
            if need_h and shard is not None:  # the shard's partial sums G_local @ W_local
                grad_h = hidden.new_zeros((m.numel(), hidden.shape[1]), dtype=cdtype)
            elif need_h:  # every row is written when all are processed
                grad_h = (hidden.new_empty if rows_idx is None else hidden.new_zeros)(hidden.shape)
            grad_w = None
            if need_w:  # written whole when a row is processed; a shard's padding rows stay 0
                written = shard is None and m.numel() > 0
                grad_w = (weight.new_empty if written else weight.new_zeros)(weight.shape)
            grad_b = bias.new_zeros(bias.shape, dtype=cdtype) if need_b else None
            grad_pass(
                head, (need_h, need_w, need_b), hidden, weight[:real],
                None if bias is None else bias[:real].to(cdtype), local_t, rows_idx, row_mask,
                inv_t, m, log_s, ent, g_lp, g_ent, grad_h,
                None if grad_w is None else grad_w[:real],
                None if grad_b is None else grad_b[:real], put_original=shard is None,
            )  # fmt: skip
        if need_h and shard is not None:  # summed over the group
            grad_h = shard_hidden_grad(grad_h, hidden, rows_idx, shard.group)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def scatter_rows(values: torch.Tensor, n: int, rows_idx, row_mask) -> torch.Tensor:
    """Processed rows' values as ``[n]``: zeros at ignored positions."""
    if rows_idx is None:
        return _zero_unkept(values, row_mask)
    out = values.new_zeros(n)
    return out.index_copy_(0, rows_idx, values)


def make_head(
    hidden, weight, bias, count: int, need, spec: HeadSpec, *, row_copies: bool,
    vocab: int | None = None, budget: int | None = None,
) -> Head:  # fmt: skip
    """The Head of a call: its GEMM dtype and the tile plan for ``count`` processed rows of a
    ``vocab``-column (default: the weight's rows) vocabulary within ``budget`` bytes (default
    ``_chunk_plan.budget_bytes``; ``kernels/_chunk_plan.py``)."""
    cdtype = head_dtype(hidden, weight, bias)
    if spec.implementation == "triton" and cdtype != torch.float32:
        raise ValueError(
            "implementation='triton' computes in float32; float64 inputs take 'chunks' or 'tiles'"
        )
    gemm16 = hidden.dtype == weight.dtype and hidden.dtype in _HALF and cdtype == torch.float32
    vocab = weight.shape[0] if vocab is None else vocab
    hidden_size = weight.shape[1]
    native16 = not gemm16 or _native_out_dtype(hidden.device, hidden.dtype)
    problem = _chunk_plan.Problem(
        count, vocab, hidden_size, gemm_sizes(hidden, weight, cdtype, gemm16), tuple(need),
        bias is not None, row_copies, native16,
    )  # fmt: skip
    plan = _chunk_plan.plan_tiles(
        problem, budget=budget or _chunk_plan.budget_bytes(count, vocab, hidden_size),
        chunk_size=spec.chunk_size, temps=_dispatch.row_ops(spec.implementation).TEMPS,
    )  # fmt: skip
    return Head(plan, spec, gemm16)


def gemm_sizes(hidden, weight, cdtype: torch.dtype, gemm16: bool) -> _chunk_plan.Sizes:
    """Bytes per element of a call's inputs, logits and GEMM operands, for the plan's models."""
    gemm = 2 if gemm16 else cdtype.itemsize
    return _chunk_plan.Sizes(hidden.dtype.itemsize, weight.dtype.itemsize, cdtype.itemsize, gemm)


def chunked_linear_logprob(inputs: HeadInputs, spec: HeadSpec, shard: VocabShard | None = None):
    """``fused_linear_logprob`` on the chunked path, from its checked inputs; with a ``shard``
    (the inputs' weight and bias its own), ``vocab_parallel_linear_logprob``'s. Returns the
    Function's output."""
    hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
    rows_idx, row_mask, inv_t = inputs.rows()
    count = hidden.shape[0] if rows_idx is None else rows_idx.numel()
    head = make_head(
        hidden, weight, bias, count, inputs.need, spec,
        vocab=None if shard is None else max(1, shard.real_rows),
        row_copies=rows_idx is not None or row_mask is not None,
    )  # fmt: skip
    return _ChunkedLinearLogProb.apply(
        hidden, weight, bias, inputs.targets, rows_idx, row_mask, inv_t, head, shard
    )
