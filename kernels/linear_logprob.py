"""Fused lm-head log-prob / entropy: ``hidden @ weight.T`` -> per-token log-prob and entropy.

The full ``[N, V]`` logits are never materialised, so the head's memory stays flat in N. Rows go
in chunks and the vocabulary in tiles; an online logsumexp merges the tiles' statistics, and the
backward recomputes the tiles the forward did not keep. The contract (semantics, dtypes, memory,
syncs, tolerances, errors) is docs/kernels.md; how this module meets it (the tile plan and its
budget, dtypes, the gradient formula, head transforms, ignored rows) is its section "How the
kernel is built".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ._checks import HeadSpec, checked_inputs, head_dtype, head_spec, no_autocast
from ._dispatch import resolve
from ._tiles import (
    _cap_slope_,
    _cast,
    _gather_tile,
    _logits_tile,
    _masked_rows,
    _merge,
    _mm_fp32,
    _or_zeros,
    _put,
    _row_affine,
    _row_factors,
    _scaled_rows,
    _scatter_tile,
    _softcap_,
    _take,
    _tile_stats,
    _zero_unkept,
)
from .chunked import chunked_linear_logprob

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._checks import HeadOptions


__all__ = ["WORKING_TILE_ELEMENTS", "fused_linear_logprob"]

# Elements of the largest [rows, vocab_tile] logits tile: 2**23 float32 = 32 MiB. Why not
# cache-sized tiles: every elementwise op is one OpenMP region whose barrier costs up to a
# scheduler slice on a busy CPU, and cache-sized tiles mean ~16x more regions per step
# (benchmarks/README.md, "Kernel design measurements").
WORKING_TILE_ELEMENTS = 8 * 1024 * 1024
# Default rows per chunk: W is streamed once per chunk and per pass, so taller chunks amortise
# it over more tokens. With the working tile it sets the vocabulary tile:
# WORKING_TILE_ELEMENTS // 1024 = 8192 columns.
_DEFAULT_ROWS = 1024
# Narrowest vocabulary tile when a caller asks for very tall chunks: thinner matmuls lose speed.
_MIN_VOCAB_TILE = 128
# Memory budget of the logits-tile buffers (the working tile and its scratch; with the tiles kept
# from forward for backward), in compute-dtype elements (_buffer_budget):
# * at most this many full tiles (4 x 32 MiB in float32): flat in N for large problems;
_BUFFER_TILES = 4
# * at most 1/_WORKING_SHARE (the two working tiles) and 1/_TOTAL_SHARE (with the kept tiles) of
#   what the materialised computation holds beyond the gradients it returns, modelled as
#   _EAGER_BUFFERS [N, V] buffers (autograd of matmul, log_softmax, gather and entropy holds five
#   at its peak; three without a backward) less the gradient buffers, which exist at eager's other
#   peak, the weight-gradient matmul, where it holds one [N, V] buffer. The kept tiles leave the
#   rest of the quarter to the [N, H] hidden gradient, row copies and allocator noise: 0.19x of
#   eager's measured extra at 256 x 896 x 151936 (40 MiB of tiles in one block per call,
#   _tile_block; a tensor per tile measured one or two tiles of heap slack on top);
_EAGER_BUFFERS, _EAGER_FORWARD_BUFFERS, _WORKING_SHARE, _TOTAL_SHARE = 5, 3, 4, 5
# * but never below this floor (1 MiB in float32): tiny problems would become op-overhead bound.
_MIN_BUFFER_ELEMENTS = 256 * 1024


@dataclass(frozen=True)
class _Plan:
    """Non-tensor arguments of the autograd Function: the call's checked ``HeadSpec`` and its
    tiles, bundled so backward returns few Nones."""

    rows: int
    vocab_tile: int
    kept_tiles: int  # logits tiles saved by forward for backward (0 when no gradient is needed)
    spec: HeadSpec
    native16: bool = False  # tile matmuls in the 16-bit input dtype with float32 output (CUDA)


def _buffer_budget(
    num_rows: int, vocab: int, hidden_size: int, need: tuple[bool, bool], share: int
) -> int:
    """Compute-dtype elements for tile buffers: a ``1/share`` of the materialised computation's
    modelled extra memory, within the cap and above the floor (see the constants)."""
    logits = num_rows * vocab
    if need[0] or need[1]:
        grads = (num_rows * hidden_size if need[0] else 0) + (vocab * hidden_size if need[1] else 0)
        eager = max(_EAGER_BUFFERS * logits - grads, logits)
    else:
        eager = _EAGER_FORWARD_BUFFERS * logits
    cap = _BUFFER_TILES * WORKING_TILE_ELEMENTS
    return min(cap, max(_MIN_BUFFER_ELEMENTS, eager // share))


def _plan(
    num_rows: int,
    vocab: int,
    spec: HeadSpec,
    need: tuple[bool, bool] = (True, True),
    native16: bool = False,
    hidden_size: int = 0,
) -> _Plan:
    """Tile sizes and kept tiles. ``need`` says which of (hidden, weight) gets a gradient.

    The vocabulary tile width depends on V and the configured chunk height only, never on the row
    count, so a row meets the same tile boundaries and the same merge order in any batch. The row
    chunk is as tall as the configured height and the memory budget (``_buffer_budget``) allow
    with two working tiles, in chunks of equal height when the budget is what limits it (which
    rows share a matmul changes BLAS blocking only, not a row's arithmetic). The tighter budget
    of all buffers keeps tiles for backward, the first ones in loop order (all of them when they
    fit: then backward recomputes no logits). A soft-capped backward with entropy holds three
    working tiles instead of two (``tanh`` is needed after the shifted logits), within the same
    budget."""
    configured = spec.chunk_size or _DEFAULT_ROWS
    vocab_tile = min(vocab, max(_MIN_VOCAB_TILE, WORKING_TILE_ELEMENTS // configured))
    budget = _buffer_budget(num_rows, vocab, hidden_size, need, _WORKING_SHARE)
    tallest = min(configured, num_rows)
    working = 3 if spec.softcap is not None and spec.with_entropy and (need[0] or need[1]) else 2
    rows = max(1, min(tallest, budget // (working * vocab_tile)))
    if rows < tallest:  # the budget limits the chunk: spread the rows evenly over the chunks
        rows = -(-num_rows // -(-num_rows // rows))
    tile = rows * vocab_tile
    kept = 0
    if need[0] or need[1]:
        count = -(-num_rows // rows) * -(-vocab // vocab_tile)
        budget = _buffer_budget(num_rows, vocab, hidden_size, need, _TOTAL_SHARE)
        kept = min(count, max(0, budget // tile - working))
    return _Plan(rows, vocab_tile, kept, spec, native16)


# (device, dtype) -> whether torch.mm(a, b, out_dtype=torch.float32, out=...) runs there.
_OUT_DTYPE_SUPPORT: dict[tuple[str, torch.dtype], bool] = {}


def _use_native16(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Tile matmuls on the 16-bit inputs with float32 accumulation and output: CUDA only, both
    inputs in one 16-bit dtype, ``torch.mm(..., out_dtype=...)`` supported (probed once per device
    and dtype). Elsewhere 16-bit operands are upcast (on a CPU fp32 GEMMs are the faster ones)."""
    dtype = hidden.dtype
    if hidden.device.type != "cuda" or weight.dtype != dtype or dtype.itemsize != 2:
        return False
    key = (str(hidden.device), dtype)
    if key not in _OUT_DTYPE_SUPPORT:
        probe = torch.ones(1, 1, dtype=dtype, device=hidden.device)
        out = torch.empty(1, 1, dtype=torch.float32, device=hidden.device)
        try:
            _mm_fp32(probe, probe, out)
            _OUT_DTYPE_SUPPORT[key] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_SUPPORT[key] = False
    return _OUT_DTYPE_SUPPORT[key]


def _as_compute(tile: torch.Tensor, wbuf: torch.Tensor | None) -> torch.Tensor:
    """A weight tile in the compute dtype: itself, or its upcast copy into ``wbuf``."""
    if wbuf is None:
        return tile
    return wbuf[: tile.numel()].view(tile.shape).copy_(tile)


class _FusedLinearLogProb(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, hidden, weight, bias, targets, rows_idx, row_mask, inv_t, plan: _Plan
    ):
        # hidden [N, H], weight [V, H], bias [V] or None, targets [N]; rows_idx [M], the rows to
        # process (the non-ignored ones), or None for all N rows in order; row_mask [N] bool (True
        # marks the non-ignored rows, which rows_idx=None then mixes with ignored ones) or None;
        # inv_t [N] or None. Shapes were flattened outside, under autograd, by the public wrapper.
        with no_autocast(hidden.device.type):
            backward = any(ctx.needs_input_grad[:3])
            out, saved = _forward(
                hidden, weight, bias, targets, rows_idx, row_mask, inv_t, plan, backward
            )
        ctx.plan = plan
        ctx.num_kept = num_kept = (len(saved) - 3) // 2
        # The kept tiles are views of the tile block saved after them: saved once, as the block
        # (a saved-tensor hook such as activation offload would copy each of them twice), and
        # rebuilt from it in backward (_kept_tiles).
        rest = (*saved[:3], *saved[3 + num_kept :])
        ctx.save_for_backward(hidden, weight, bias, targets, rows_idx, row_mask, inv_t, *rest)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprob, grad_entropy=None):
        saved = ctx.saved_tensors
        if ctx.num_kept:
            kept = _kept_tiles(saved[-1], ctx.plan, ctx.num_kept)
            saved = (*saved[:10], *kept, *saved[10:])
        need = ctx.needs_input_grad[:3]
        with no_autocast(saved[0].device.type):
            grad_h, grad_w, grad_b = _backward(
                saved, ctx.num_kept, ctx.plan, need, grad_logprob, grad_entropy
            )
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _forward(
    hidden, weight, bias, targets, rows_idx, row_mask, inv_t, plan: _Plan, backward: bool = False
):
    # backward: a backward will run (the autograd Function: an input needs a gradient), so the
    # working tiles are saved for it even when no tile is kept (kept tiles imply one).
    cdtype = head_dtype(hidden, weight, bias)
    bias_c = None if bias is None else bias.to(cdtype)
    n, vocab = hidden.shape[0], weight.shape[0]
    m = n if rows_idx is None else rows_idx.numel()
    new = hidden.new_empty if rows_idx is None else hidden.new_zeros  # every row written, or not
    logprob = new(n, dtype=cdtype)
    entropy = new(n, dtype=cdtype) if plan.spec.with_entropy else None
    max_all = hidden.new_empty(m, dtype=cdtype)
    sum_all = hidden.new_empty(m, dtype=cdtype)
    ent_all = hidden.new_empty(m, dtype=cdtype) if plan.spec.with_entropy else None
    # One allocation for the call's tile buffers (_tile_block): the working tiles, which backward
    # reuses (as many as it needs), and the kept tiles.
    backward = backward or plan.kept_tiles > 0
    tiles = -(-m // plan.rows) * -(-vocab // plan.vocab_tile)
    working = _working_tiles(plan, tiles > plan.kept_tiles) if backward else 2
    block, wbuf, work = _tile_block(hidden, weight, plan, cdtype, working, plan.kept_tiles)
    scratch, buf = work[0], work[1]  # buf: the working tile, for the tiles not kept
    kept_tiles = work[working:]  # flat views of the block, filled with z - m_tile in loop order
    kept, kept_max = [], []
    for start in range(0, m, plan.rows):
        rows = slice(start, min(start + plan.rows, m))
        idx = None if rows_idx is None else rows_idx[rows]
        inv = _take(inv_t, rows, idx) if inv_t is not None else plan.spec.inv_temperature
        real = None if row_mask is None else _take(row_mask, rows, idx)
        h = _masked_rows(_take(hidden, rows, idx), real)
        pre, post, _ = _row_factors(inv, plan.spec.logit_scale, plan.spec.softcap)
        h_mm = h if plan.native16 else _scaled_rows(h.to(cdtype), pre)
        t = _take(targets, rows, idx)
        target_logit = hidden.new_zeros(h.shape[0], dtype=cdtype)
        stats = None
        for j in range(0, vocab, plan.vocab_tile):
            keep = len(kept) < plan.kept_tiles
            out = kept_tiles[len(kept)] if keep else buf
            if keep:
                kept.append(out)
            w_tile = weight[j : j + plan.vocab_tile]
            w_mm = w_tile if plan.native16 else _as_compute(w_tile, wbuf)
            b_tile = None if bias_c is None else bias_c[j : j + plan.vocab_tile]
            z = _logits_tile(h_mm, w_mm, pre, out, plan.native16, b_tile)
            if post is not None:
                _softcap_(z, post)
            _gather_tile(z, t - j, target_logit)
            tile = _tile_stats(z, scratch, plan.spec.with_entropy)
            stats = tile if stats is None else _merge(stats, tile)
            if keep:
                kept_max.append(tile[0])
        row_max, row_sum, row_a = stats
        log_sum = row_sum.log()
        max_all[rows], sum_all[rows] = row_max, row_sum
        # log p(target) = (z_t - m) - log S: both differences are small, exact near the max.
        _put(logprob, rows, idx, _zero_unkept((target_logit - row_max) - log_sum, real))
        if plan.spec.with_entropy:
            ent_all[rows] = log_sum - row_a / row_sum  # H = log S - E[z - m]
            _put(entropy, rows, idx, _zero_unkept(ent_all[rows], real))
    out = (logprob, entropy) if plan.spec.with_entropy else logprob
    # saved: (max, sum, entropy, *kept, *kept_max[, block]), so (len - 3) // 2 tiles are kept; the
    # block, when a backward will run, gives it its working tiles.
    return out, (max_all, sum_all, ent_all, *kept, *kept_max, *([block] if backward else []))


def _backward(saved, num_kept, plan: _Plan, need, grad_logprob, grad_entropy, grad_w_acc=None):
    # grad_w_acc: a compute-dtype [V, H] buffer to accumulate the weight gradient into (returned
    # as is, not cast), for a caller that runs this once per row group (kernels/fused_loss.py).
    hidden, weight, bias, targets, rows_idx, row_mask, inv_t = saved[:7]
    max_all, sum_all, ent_all = saved[7:10]
    kept, kept_max = saved[10 : 10 + num_kept], saved[10 + num_kept : 10 + 2 * num_kept]
    block = saved[10 + 2 * num_kept] if len(saved) > 10 + 2 * num_kept else None  # forward's
    need_h, need_w, need_b = need
    need_b = need_b and bias is not None
    cdtype = head_dtype(hidden, weight, bias)
    bias_c = None if bias is None else bias.to(cdtype)
    n = hidden.shape[0]
    m = n if rows_idx is None else rows_idx.numel()
    if rows_idx is None:  # every row is written below
        grad_h = hidden.new_empty(hidden.shape) if need_h else None
    else:
        grad_h = hidden.new_zeros(hidden.shape) if need_h else None
    # The bias gradient is the column sums of G, accumulated in the compute dtype.
    grad_b = bias.new_zeros(bias.shape, dtype=cdtype) if need_b else None
    if not (need_h or need_w or need_b) or m == 0:
        zero_w = torch.zeros_like(weight) if need_w and grad_w_acc is None else grad_w_acc
        return grad_h, zero_w, _cast(grad_b, bias.dtype if need_b else None)
    # The weight gradient accumulates over row chunks in the compute dtype (one rounding at the
    # end for a 16-bit weight). No zero fill: the first row chunk overwrites every tile of it
    # (beta=0 below). With a single row chunk there is nothing to accumulate: each tile is formed
    # in a tile buffer and rounded straight into a 16-bit gradient, so no [V, H] float32 buffer.
    direct_w = need_w and weight.dtype != cdtype and m <= plan.rows and grad_w_acc is None
    grad_w = weight.new_empty(weight.shape, dtype=None if direct_w else cdtype) if need_w else None
    if need_w and grad_w_acc is not None:
        grad_w = grad_w_acc
    # A missing upstream gradient is a zero gradient, never a dropped branch.
    g_lp_all = _or_zeros(grad_logprob, n, hidden, cdtype)
    g_ent_all = _or_zeros(grad_entropy if plan.spec.with_entropy else None, n, hidden, cdtype)
    if row_mask is not None:  # upstream gradients of ignored rows are dropped, NaN or not
        g_lp_all = _zero_unkept(g_lp_all, row_mask)
        g_ent_all = _zero_unkept(g_ent_all, row_mask)
    use_entropy = plan.spec.with_entropy  # no all-zero skip: finding out would be a host sync
    size = plan.rows * plan.vocab_tile
    tiles = -(-m // plan.rows) * -(-weight.shape[0] // plan.vocab_tile)
    working = _working_tiles(plan, tiles > num_kept)
    if block is None:  # forward's block is gone (a direct caller's): one block for backward's
        _, wbuf, work = _tile_block(hidden, weight, plan, cdtype, working, 0)
    else:  # forward's block: its working tiles (and upcast buffer) are free again. Through
        # .data, a tensor with a version counter of its own: writing there does not mark the saved
        # kept tiles modified, so a retained graph can run backward again.
        wbuf, work = _block_views(block.data, weight, plan, cdtype, working)
    scratch, buf = work[0], work[1]
    # Soft-capping with entropy: s = z - m goes next to tanh in a third working tile.
    shifted_buf = work[2] if working == 3 else None
    low_buf = hidden.new_empty(size) if plan.native16 else None
    if direct_w and wbuf is None:  # native16: no upcast buffer to reuse for the tile
        wbuf = weight.new_empty(plan.vocab_tile * weight.shape[1], dtype=cdtype)
    gh_in_place = need_h and rows_idx is None and hidden.dtype == cdtype
    vocab, tile_index = weight.shape[0], 0
    for start in range(0, m, plan.rows):
        rows = slice(start, min(start + plan.rows, m))
        idx = None if rows_idx is None else rows_idx[rows]
        real = None if row_mask is None else _take(row_mask, rows, idx)
        h = _masked_rows(_take(hidden, rows, idx), real)
        inv = _take(inv_t, rows, idx) if inv_t is not None else plan.spec.inv_temperature
        pre, post, dz = _row_factors(inv, plan.spec.logit_scale, plan.spec.softcap)
        h_c = h if plan.native16 else h.to(cdtype)  # unscaled: the weight gradient's operand
        h_mm = h_c if plan.native16 else _scaled_rows(h_c, pre)
        row_max = max_all[rows].unsqueeze(1)
        inv_sum = sum_all[rows].reciprocal()
        # G below is the gradient with respect to z = h @ W.T + b: the logits' gradient times
        # d logits / dz = scale / T, and the soft-capping slope 1 - tanh**2 applied per element.
        g_lp = _take(g_lp_all, rows, idx) * dz
        g_ent = _take(g_ent_all, rows, idx) * dz
        # With s = z - m, e = exp(s), p = e / S and log p = s - log S, the tile gradient
        # G = p * (b * log p + c) = e * (b / S * s + (c - b * log S) / S), + g_lp at the target.
        b = -g_ent
        c = -(g_lp + g_ent * ent_all[rows]) if use_entropy else -g_lp
        if use_entropy:
            c = c - b * sum_all[rows].log()
        b, c = (b * inv_sum).unsqueeze(1), (c * inv_sum).unsqueeze(1)
        gh = h.new_empty(h.shape, dtype=cdtype) if need_h and not gh_in_place else None
        if gh_in_place:  # accumulate straight into the gradient's rows
            gh = grad_h[rows]
        t = _take(targets, rows, idx)
        for j in range(0, vocab, plan.vocab_tile):
            w_tile = weight[j : j + plan.vocab_tile]
            r, w = h.shape[0], w_tile.shape[0]
            e = scratch[: r * w].view(r, w)
            z = buf[: r * w].view(r, w)
            w_mm = w_tile
            if tile_index < len(kept):  # forward's s_t = z - m_t, no matmul
                # exp(z - m) = exp(s_t) * f with f = exp(m_t - m) <= 1, and z - m = s_t - (m - m_t):
                # G = exp(s_t) * (b' s_t + c') with b' = b f, c' = (c - b (m - m_t)) f.
                s_tile = kept[tile_index][: r * w].view(r, w)
                shift = row_max - kept_max[tile_index].unsqueeze(1)
                f = torch.exp(-shift)
                g = torch.exp(s_tile, out=e)
                if use_entropy:
                    g.mul_(torch.addcmul((c - b * shift) * f, s_tile, b * f, out=z))
                else:
                    g.mul_(c * f)
                if post is not None:  # tanh = logit / post = (s_t + m_t) / post, into z
                    inv_post = post.reciprocal() if isinstance(post, torch.Tensor) else 1.0 / post
                    _row_affine(s_tile, kept_max[tile_index] * inv_post, inv_post, z)
                if need_h and not plan.native16:
                    w_mm = _as_compute(w_tile, wbuf)
            else:
                if not plan.native16:
                    w_mm = _as_compute(w_tile, wbuf)
                b_tile = None if bias_c is None else bias_c[j : j + plan.vocab_tile]
                z = _logits_tile(h_mm, w_mm, pre, buf, plan.native16, b_tile)
                if post is None:
                    s = z.sub_(row_max)
                    g = torch.exp(s, out=e)
                else:  # z keeps tanh for the slope; s = post * tanh - m goes next to it
                    z.tanh_()
                    s = shifted_buf[: r * w].view(r, w) if use_entropy else e
                    g = torch.exp(_row_affine(z, -max_all[rows], post, s), out=e)
                if use_entropy:
                    g.mul_(torch.addcmul(c, s, b, out=s))
                else:
                    g.mul_(c)
            tile_index += 1
            _scatter_tile(g, t - j, g_lp)
            if post is not None:  # z holds tanh: the soft-capping slope 1 - tanh**2
                g.mul_(_cap_slope_(z))
            if need_b:
                grad_b[j : j + plan.vocab_tile] += g.sum(dim=0)
            # 16-bit tensor-core matmuls take G rounded to the input dtype (float32 accumulation
            # and output); everywhere else G stays in the compute dtype.
            g_mm = low_buf[: g.numel()].view_as(g).copy_(g) if plan.native16 else g
            if need_h:
                _addmm(gh, g_mm, w_mm, overwrite=j == 0)
            if need_w and direct_w:  # wbuf's weight tile is used up: reuse it
                tile = wbuf[: w_tile.numel()].view(w_tile.shape)
                _addmm(tile, g_mm.T, h_c, overwrite=True)
                grad_w[j : j + plan.vocab_tile].copy_(tile)
            elif need_w:
                overwrite = start == 0 and grad_w_acc is None
                _addmm(grad_w[j : j + plan.vocab_tile], g_mm.T, h_c, overwrite=overwrite)
        if need_h and not gh_in_place:
            _put(grad_h, rows, idx, gh.to(hidden.dtype))
    grad_w = grad_w if grad_w_acc is not None else _cast(grad_w, weight.dtype)
    return grad_h, grad_w, _cast(grad_b, bias.dtype if need_b else None)


def _working_tiles(plan: _Plan, recompute: bool) -> int:
    """Working tiles of a backward (``recompute``: some tile is not kept): the logits tile and its
    scratch, and a third one for soft-capping with entropy on a recomputed tile (``s = z - m``
    next to ``tanh``). ``_plan`` budgets for as many."""
    return 3 if recompute and plan.spec.softcap is not None and plan.spec.with_entropy else 2


def _upcast_elements(weight: torch.Tensor, plan: _Plan, cdtype: torch.dtype) -> int:
    """Room for one upcast weight tile: a weight not in the compute dtype (and not ``native16``)."""
    upcast = weight.dtype != cdtype and not plan.native16
    return plan.vocab_tile * weight.shape[1] if upcast else 0


def _tile_block(hidden, weight, plan: _Plan, cdtype, working: int, kept: int):
    """A phase's tile buffers in one compute-dtype allocation: the upcast weight buffer (if any),
    then ``working + kept`` flat tiles of ``rows * vocab_tile`` elements.

    One block, not a tensor per tile: glibc serves a request from mmap only above its mmap
    threshold, which it raises (up to 32 MiB) to the size of each mmapped chunk freed. Tiles under
    32 MiB (short row chunks) then come from the heap, where a freed tile stays resident and
    the interleaved allocations of a step fragment it: one or two tiles of peak RSS beyond the
    live buffers at 256 x 896 x 151936 (benchmarks/README.md, issue 23). One block, allocated
    once and held until backward is done, leaves no freed tile for the step's other allocations
    to split: the peak RSS is the live buffers. Returns ``(block, wbuf or None, [tiles])``."""
    upcast = _upcast_elements(weight, plan, cdtype)
    size = plan.rows * plan.vocab_tile
    block = hidden.new_empty(upcast + (working + kept) * size, dtype=cdtype)
    wbuf, tiles = _block_views(block, weight, plan, cdtype, working + kept)
    return block, wbuf, tiles


def _kept_tiles(block: torch.Tensor, plan: _Plan, count: int) -> tuple[torch.Tensor, ...]:
    """The first ``count`` kept tiles of a forward's ``_tile_block``: its last ``kept_tiles``
    tiles are the kept ones, filled in loop order."""
    size = plan.rows * plan.vocab_tile
    start = block.numel() - plan.kept_tiles * size
    return block[start : start + count * size].view(count, size).unbind()


def _block_views(block: torch.Tensor, weight, plan: _Plan, cdtype, count: int):
    """The upcast weight buffer (or None) and the first ``count`` tiles of a ``_tile_block``."""
    upcast = _upcast_elements(weight, plan, cdtype)
    size = plan.rows * plan.vocab_tile
    tiles = [block[upcast + k * size : upcast + (k + 1) * size] for k in range(count)]
    return (block[:upcast] if upcast else None), tiles


def _addmm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool) -> None:
    """``acc += a @ b`` (``acc = a @ b`` when ``overwrite``: uninitialised ``acc`` is ignored) with
    ``acc`` in the compute dtype; ``a``, ``b`` in the compute dtype too, or 16-bit (``native16``:
    float32 accumulation and output)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=0.0 if overwrite else 1.0)
    elif overwrite:
        _mm_fp32(a, b, acc)
    else:
        acc += _mm_fp32(a, b, torch.empty_like(acc))


def _native16(hidden, weight, bias) -> bool:
    """Whether the 16-bit CUDA tile matmuls apply (``_use_native16``): not with a float64 bias,
    which makes the compute dtype float64."""
    return _use_native16(hidden, weight) and (bias is None or bias.dtype != torch.float64)


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    **head: Unpack[HeadOptions],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of an lm-head, without materialising the logits.

    ``log_softmax(cap((hidden.float() @ weight.float().T + bias) * logit_scale) / temperature)``
    gathered at ``targets``, with ``cap(x) = softcap * tanh(x / softcap)`` (identity when
    ``softcap`` is None), and the entropy of that distribution, computed in float32 (float64 when
    an input is float64) whatever the input dtypes and autocast state: the logits are never
    rounded to 16 bits. Values equal those of :func:`microrl.kernels.reference_linear_logprob`
    (the eager definition) to the compute dtype's rounding, not bitwise. Gradients go to
    ``hidden``, ``weight`` and ``bias``, each only when it requires grad, in its own dtype. Full
    contract: ``docs/kernels.md``.

    Args (the keywords are :class:`~microrl.kernels._checks.HeadOptions`, defaults in brackets):
        hidden: ``[..., H]`` float32/bfloat16/float16/float64, any strides.
        weight: ``[V, H]`` lm-head weight, any of those dtypes; it need not match ``hidden``'s
            (e.g. bf16 activations with a float32 weight): both are upcast to the compute dtype.
        targets: ``[...]`` integer ids in ``[0, V)``, or ``ignore_index``: those positions give
            log-prob 0 and entropy 0, and no gradient (their hidden rows are never read).
        temperature: [1.0] float > 0, or a tensor broadcastable to ``targets.shape`` (per token /
            per row; no gradient flows to it).
        with_entropy: [True] False returns ``None`` for the entropy and skips its passes.
        chunk_size: [None] rows per chunk (at most; small problems may use fewer); ``None`` uses
            1024. It sets the vocabulary tile, ``WORKING_TILE_ELEMENTS // chunk_size`` columns
            (at least 128, at most V), independently of the row count. Extra memory: compute-dtype
            tile buffers (two working tiles and the tiles kept from forward for backward, one block
            held from forward to the end of backward) within four full tiles (4 x 32 MiB in
            float32 by default) whatever N, and within a quarter of the materialised
            computation's extra memory for small problems (docs/kernels.md), plus
            ``[rows, H]`` row copies and O(N) statistics. A weight not in the compute dtype also
            gets a ``[vocab_tile, H]`` upcast buffer and, when it requires grad and there is more
            than one row chunk, a compute-dtype ``[V, H]`` gradient accumulator.
        ignore_index: [-100] target id that marks a position with no prediction.
        validate: [True] True checks the target range and the temperature values on the device,
            with one device-to-host sync per call (which also counts the non-ignored rows, so only
            those are computed). False issues no sync at all (forward and backward), for callers
            in a hot loop that validated the values already, as the engine does for ``input_ids``
            against the vocabulary at the batch boundary. Only skip when every target is known to
            be in ``[0, V)`` or ``ignore_index`` and every temperature finite and > 0: otherwise
            the results are silently wrong (no error). It then computes every row, ignored ones
            included (masked, docs/kernels.md): same results, more work when many
            positions are ignored.
        bias: [None] ``[V]`` lm-head bias (Phi), any float dtype, or None; gets a gradient when it
            requires grad.
        logit_scale: [1.0] finite float > 0 multiplying the logits after the bias and before the
            soft-capping (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``).
        softcap: [None] None, or a finite float ``c > 0``: final-logit soft-capping
            ``c * tanh(x / c)`` (Gemma 2/3 ``final_logit_softcapping``), before the temperature.
        implementation: [``"auto"``] ``"auto"`` (CUDA tensors take the GPU path, ``"triton"``, or
            ``"chunks"`` without Triton; other devices ``"tiles"``), or one of those names to
            force it (docs/kernels.md, "Implementations"); on the GPU path ``chunk_size`` caps the
            rows of a tile and the tile is sized by a budget of about ``4 * N * H`` bytes.
            :func:`microrl.kernels.last_implementation` says which one ran.

    Returns:
        ``(logprobs [...], entropy [...] | None)`` shaped like ``targets``, float32 (float64 when
        an input is float64).

    Raises:
        TypeError: ``hidden``, ``weight`` or ``targets`` not a tensor.
        ValueError: shape mismatch, ``weight`` not ``[V, H]``, non-float ``hidden``/``weight``,
            tensors on different devices, non-integer targets, temperature of a bad type or
            shape (or requiring grad), ``chunk_size < 1``, non-bool ``with_entropy``/``validate``,
            non-int ``ignore_index``, ``bias`` not ``[V]`` or not a float tensor on the same
            device, ``logit_scale`` or ``softcap`` not a finite number > 0, an unknown
            ``implementation`` (or ``"triton"`` with float64 inputs); with ``validate``, also
            out-of-range targets and temperatures <= 0 or non-finite.
    """
    spec, temperature, bias = head_spec("fused_linear_logprob", head)
    spec, inputs = checked_inputs(hidden, weight, targets, temperature, bias, spec)
    spec = resolve(hidden, weight, bias, spec, "fused_linear_logprob")
    if spec.implementation != "tiles":
        return _shaped(chunked_linear_logprob(inputs, spec), targets.shape, spec.with_entropy)
    rows_idx, row_mask, inv_t = inputs.rows()
    need = inputs.need[:2]
    if inputs.need[2] and not any(need):  # a backward runs for the bias alone: plan for one
        need = True, False
    num_rows = inputs.valid.numel() if rows_idx is None else rows_idx.numel()
    vocab, hidden_size = weight.shape
    native16 = _native16(hidden, weight, bias)
    plan = _plan(max(1, num_rows), vocab, spec, need, native16, hidden_size)
    out = _FusedLinearLogProb.apply(
        inputs.hidden, weight, bias, inputs.targets, rows_idx, row_mask, inv_t, plan
    )
    return _shaped(out, targets.shape, spec.with_entropy)


def _shaped(out, shape: torch.Size, with_entropy: bool):
    """The Function's flat output(s) as ``(logprobs, entropy | None)`` shaped like the targets."""
    if not with_entropy:
        return out.view(shape), None
    logprobs, entropy = out
    return logprobs.view(shape), entropy.view(shape)
