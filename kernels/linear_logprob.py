"""Fused lm-head log-prob / entropy: ``hidden @ weight.T`` -> per-token log-prob and entropy.

The contract (semantics, dtypes, memory, syncs, tolerances, errors) is in ``docs/kernels.md``;
this docstring describes how the kernel meets it.

The full ``[N, V]`` logits are never materialised. Rows are processed in chunks of ``rows`` tokens
and the vocabulary in tiles of ``vocab_tile`` columns, so the working set is one ``[rows,
vocab_tile]`` logits tile plus one scratch tile of the same size (and ``_KEPT_TILES`` tiles held
for backward), independent of N. The vocabulary tiles depend on V and the configured chunk
height only, never on N (``_plan``), so a row meets the same tile boundaries and merge order in
any batch; small problems get shorter row chunks instead.

All arithmetic is in the compute dtype, float32 (float64 when an input is float64): the logits
are never rounded to 16 bits. 16-bit (or mixed) inputs are upcast per row chunk (``[rows, H]``)
and per weight tile (``[vocab_tile, H]``, one reused buffer), so every matmul is a float32 one,
which on a CPU is also faster than a 16-bit one. On CUDA, when both inputs share one 16-bit dtype
and ``torch.mm(..., out_dtype=torch.float32)`` is supported (probed once), the tile matmuls run
on the 16-bit inputs with float32 accumulation and float32 output instead ("native16"), the
temperature is applied to the float32 tile, and backward feeds the tensor cores the logit
gradient rounded to the input dtype (float32 accumulation). Autocast is disabled inside.

Forward, per row chunk: for each vocabulary tile, ``z = (h / T) @ W_tile.T``, the tile's
logsumexp and entropy, merged into running per-row statistics with the max-rescaled (online)
logsumexp, so every value stays finite for huge logits and for rows whose logits are all very
negative. Statistics are kept as (max ``m``, ``S = sum exp(z - m)``), never as a rounded ``lse``:
``z - m`` is exact near the max, which keeps float32 results for logits of size 1e4 as accurate
as the eager reference. The target logit is gathered from its tile. Only O(N) statistics are
saved for backward: per-row ``m``, ``S`` and entropy.

Backward recomputes each logits tile (one more matmul) instead of keeping ``[N, V]`` of them from
the forward: keeping would cost 6*N*H*V flops instead of 8*N*H*V, but memory that grows with N.
Upstream gradients are unknown in forward, so the gradient cannot be formed there either. The
middle ground taken: the forward keeps a fixed number of tiles (``_KEPT_TILES``, as ``z - m_tile``)
whose recompute backward then skips, so memory stays flat in N (7.5*N*H*V flops at N=2048,
V=32768 instead of 8). The extra matmul is paid back on a CPU by the elementwise work: about ten
passes over each tile in all, against ~25 passes over full ``[N, V]`` buffers (plus page faults)
in eager autograd. With ``z`` the tempered logits, ``p = softmax(z)``, ``H`` the entropy and
upstream gradients ``g_lp``, ``g_H`` per row, the gradient with respect to the untempered logits
is::

    dL/dlogit_j = (g_lp * [j == target] - p_j * (g_lp + g_H * (log p_j + H))) / T

(``dH/dz_j = -p_j (log p_j + H)``), computed in place on the tile in four elementwise passes
(``z - m``, ``exp``, the per-row affine factor, the product; the ``[j == target]`` term is an
O(rows) scatter) and followed by ``grad_hidden += G @ W_tile`` and ``grad_weight[tile] += G.T @
h`` (compute-dtype accumulators, cast to each input's dtype once at the end), each skipped when
``ctx.needs_input_grad`` says that input does not need a gradient (a frozen weight gets no
``[V, H]`` buffer and no matmul). Upstream gradients stay materialised (a missing one arrives as
zeros), so no branch can be dropped; with ``with_entropy`` the entropy passes always run (skipping
them for an all-zero entropy gradient would need a host sync to find out).

Ignored rows (``ignore_index``): with ``validate=True`` the one host sync of the input check also
reads their count, and the non-ignored rows are compacted (``nonzero_static``): ignored rows are
never read, their outputs and gradients are zero. With ``validate=False`` (no host sync at all, for
the engine's micro-batch loop) every row is processed and the ignored ones are masked with
``torch.where`` before any arithmetic: hidden row and temperature replaced (by 0 and 1), target
by 0, upstream gradients and outputs by 0, so garbage (NaN/inf) there cannot leak anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ._checks import check_linear_logprob_inputs, compute_dtype, no_autocast

__all__ = ["WORKING_TILE_ELEMENTS", "fused_linear_logprob"]

# Elements of one [rows, vocab_tile] logits tile. Two such float32 tiles (logits + scratch) are
# the extra working memory for the logits: 2 * 4 * 2**23 bytes = 64 MiB whatever N (eager holds
# several [N, V] buffers: ~1.3 GB at N=2048, V=32768). Why not cache-sized tiles: every
# elementwise op is one OpenMP region whose barrier costs up to a scheduler slice on a busy CPU;
# 2 MiB tiles meant ~2000 regions per step and ran 2-3x slower there, 32 MiB tiles ~120.
WORKING_TILE_ELEMENTS = 8 * 1024 * 1024
# Small problems are cut into at least this many tiles (by shorter row chunks: the vocabulary
# tile is fixed), so the four tile-sized buffers (two working, two kept) stay within half of one
# [N, V] logits buffer, i.e. ~10% of what eager holds, at any size; the floor keeps tiny problems
# from becoming op-overhead bound (at least 8 rows per chunk with the default 8192-column tile).
_MIN_TILES = 8
_MIN_TILE_ELEMENTS = 64 * 1024
# Default rows per chunk: W is streamed once per chunk and per pass, so taller chunks amortise
# it over more tokens (measured ~4% faster than 512 on this CPU). With the working tile it sets
# the vocabulary tile: WORKING_TILE_ELEMENTS // 1024 = 8192 columns.
_DEFAULT_ROWS = 1024
# Narrowest vocabulary tile when a caller asks for very tall chunks: thinner matmuls lose speed.
_MIN_VOCAB_TILE = 128
# Logits tiles the forward keeps for backward instead of recomputing them (when a gradient will be
# needed): each saves one tile matmul (1/4 of that tile's flops) for one tile of memory. A fixed
# amount (this many full-size tiles' worth, more tiles when N cuts them short), so the extra
# memory stays (2 + 2) tiles = 128 MiB in float32 whatever N; larger problems simply recompute a
# larger share.
_KEPT_TILES = 2


@dataclass(frozen=True)
class _Plan:
    """Non-tensor arguments of the autograd Function, bundled so backward returns few Nones."""

    rows: int
    vocab_tile: int
    with_entropy: bool
    inv_temperature: float  # used when no per-token temperature tensor is given
    kept_tiles: int  # logits tiles saved by forward for backward (0 when no gradient is needed)
    native16: bool = False  # tile matmuls in the 16-bit input dtype with float32 output (CUDA)


def _plan(
    num_rows: int,
    vocab: int,
    chunk_size: int | None,
    with_entropy: bool,
    inv: float,
    needs_grad: bool = True,
    native16: bool = False,
) -> _Plan:
    """Tile sizes. The vocabulary tile width depends on V and the configured chunk height only,
    never on the row count, so a row meets the same tile boundaries and the same merge order in
    any batch. Small problems get shorter row chunks instead (which rows share a matmul does not
    change a row's arithmetic, only BLAS blocking), so that one tile holds at most 1/_MIN_TILES of
    the [N, V] logits (floor _MIN_TILE_ELEMENTS)."""
    configured = chunk_size or _DEFAULT_ROWS
    vocab_tile = min(vocab, max(_MIN_VOCAB_TILE, WORKING_TILE_ELEMENTS // configured))
    budget = max(_MIN_TILE_ELEMENTS, -(-num_rows * vocab // _MIN_TILES))
    rows = max(1, min(configured, num_rows, budget // vocab_tile))
    # Kept for backward: _KEPT_TILES tiles' worth of the largest tile this problem may use, so
    # tiles cut short by a small N keep as many logits (and save as many flops) as full ones.
    full = min(WORKING_TILE_ELEMENTS, budget)
    kept = _KEPT_TILES * max(1, full // (rows * vocab_tile)) if needs_grad else 0
    return _Plan(rows, vocab_tile, with_entropy, inv, kept, native16)


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


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` for 16-bit ``a``, ``b`` with float32 accumulation and float32 ``out``."""
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def _scaled_rows(h: torch.Tensor, inv: torch.Tensor | float) -> torch.Tensor:
    """``h / T`` in the compute dtype: folded into the rows, it saves a pass over every tile."""
    if isinstance(inv, torch.Tensor):
        return h * inv.unsqueeze(1)
    return h * inv if inv != 1.0 else h


def _as_compute(tile: torch.Tensor, wbuf: torch.Tensor | None) -> torch.Tensor:
    """A weight tile in the compute dtype: itself, or its upcast copy into ``wbuf``."""
    if wbuf is None:
        return tile
    return wbuf[: tile.numel()].view(tile.shape).copy_(tile)


def _logits_tile(h_mm, w_mm, inv, buf, native16):
    """``[r, w]`` tempered logits of one tile in the compute dtype, written into ``buf``: from
    rows already divided by T and a weight tile, both in the compute dtype, or (``native16``) from
    the 16-bit inputs, with float32 output then divided by T."""
    r, w = h_mm.shape[0], w_mm.shape[0]
    z = buf[: r * w].view(r, w)
    if not native16:
        return torch.mm(h_mm, w_mm.T, out=z)
    _mm_fp32(h_mm, w_mm.T, z)
    if isinstance(inv, torch.Tensor):
        return z.mul_(inv.unsqueeze(1))
    return z.mul_(inv) if inv != 1.0 else z


def _tile_stats(z: torch.Tensor, scratch: torch.Tensor, with_entropy: bool):
    """Row statistics of one tile ``z`` (left holding ``z - m``): max ``m``, ``S = sum exp(z - m)``
    and, for the entropy, ``A = sum exp(z - m) * (z - m)`` (<= 0, no cancellation)."""
    m = z.amax(dim=1, keepdim=True)
    z.sub_(m)
    e = torch.exp(z, out=scratch[: z.numel()].view_as(z))
    s = e.sum(dim=1)
    # e is dead after this: the in-place product is faster on CPU than a batched GEMV dot.
    return m.squeeze(1), s, e.mul_(z).sum(dim=1) if with_entropy else None


def _merge(run, tile):
    """Online (max-rescaled) merge of the statistics of two disjoint vocabulary parts.

    Rescaling part r from its max ``m_r`` to the joint max ``m``: ``S_r -> a_r * S_r`` and
    ``A_r -> a_r * (A_r + (m_r - m) * S_r)`` with ``a_r = exp(m_r - m) <= 1``: nothing overflows.
    """
    (m_r, s_r, a_r), (m_t, s_t, a_t) = run, tile
    m = torch.maximum(m_r, m_t)
    d_r, d_t = m_r - m, m_t - m
    w_r, w_t = d_r.exp(), d_t.exp()
    s = w_r * s_r + w_t * s_t
    a = None if a_r is None else w_r * (a_r + d_r * s_r) + w_t * (a_t + d_t * s_t)
    return m, s, a


def _gather_tile(z: torch.Tensor, local_targets: torch.Tensor, picked: torch.Tensor) -> None:
    """Copy ``z[i, local_targets[i]]`` into ``picked[i]`` for the targets inside this tile."""
    inside = (local_targets >= 0) & (local_targets < z.shape[1])
    values = z.gather(1, local_targets.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    picked.copy_(torch.where(inside, values, picked))


class _FusedLinearLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, hidden, weight, targets, rows_idx, row_mask, inv_t, plan: _Plan):
        # hidden [N, H], weight [V, H], targets [N], rows_idx [M] (the rows to process), row_mask
        # [N] bool (rows_idx covers ignored rows too: True marks the non-ignored ones) or None
        # (rows_idx holds only non-ignored rows), inv_t [N] or None. Shapes were flattened
        # outside, under autograd, by the public wrapper.
        with no_autocast(hidden.device.type):
            out, saved = _forward(hidden, weight, targets, rows_idx, row_mask, inv_t, plan)
        ctx.save_for_backward(hidden, weight, targets, rows_idx, row_mask, inv_t, *saved)
        ctx.plan = plan
        ctx.num_kept = (len(saved) - 3) // 2
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprob, grad_entropy=None):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with no_autocast(saved[0].device.type):
            grad_h, grad_w = _backward(
                saved, ctx.num_kept, ctx.plan, need, grad_logprob, grad_entropy
            )
        return grad_h, grad_w, None, None, None, None, None


def _forward(hidden, weight, targets, rows_idx, row_mask, inv_t, plan: _Plan):
    cdtype = compute_dtype(hidden.dtype, weight.dtype)
    n, vocab = hidden.shape[0], weight.shape[0]
    logprob = hidden.new_zeros(n, dtype=cdtype)
    entropy = hidden.new_zeros(n, dtype=cdtype) if plan.with_entropy else None
    m = rows_idx.numel()
    max_all = hidden.new_empty(m, dtype=cdtype)
    sum_all = hidden.new_empty(m, dtype=cdtype)
    ent_all = hidden.new_empty(m, dtype=cdtype) if plan.with_entropy else None
    buf, scratch, _, wbuf = _buffers(hidden, weight, plan, cdtype)
    kept, kept_max = [], []  # tiles holding z - m_tile, and m_tile, in loop order
    for start in range(0, m, plan.rows):
        idx = rows_idx[start : start + plan.rows]
        rows = slice(start, start + plan.rows)
        inv = inv_t.index_select(0, idx) if inv_t is not None else plan.inv_temperature
        real = None if row_mask is None else row_mask.index_select(0, idx)
        h = _masked_rows(hidden, idx, real)
        h_mm = h if plan.native16 else _scaled_rows(h.to(cdtype), inv)
        t = targets.index_select(0, idx)
        target_logit = hidden.new_zeros(idx.numel(), dtype=cdtype)
        stats = None
        for j in range(0, vocab, plan.vocab_tile):
            keep = len(kept) < plan.kept_tiles
            out = hidden.new_empty(buf.numel(), dtype=cdtype) if keep else buf
            w_tile = weight[j : j + plan.vocab_tile]
            w_mm = w_tile if plan.native16 else _as_compute(w_tile, wbuf)
            z = _logits_tile(h_mm, w_mm, inv, out, plan.native16)
            _gather_tile(z, t - j, target_logit)
            tile = _tile_stats(z, scratch, plan.with_entropy)
            stats = tile if stats is None else _merge(stats, tile)
            if keep:
                kept.append(z)
                kept_max.append(tile[0])
        row_max, row_sum, row_a = stats
        log_sum = row_sum.log()
        max_all[rows], sum_all[rows] = row_max, row_sum
        # log p(target) = (z_t - m) - log S: both differences are small, exact near the max.
        logprob.index_copy_(0, idx, _zero_unkept((target_logit - row_max) - log_sum, real))
        if plan.with_entropy:
            ent_all[rows] = log_sum - row_a / row_sum  # H = log S - E[z - m]
            entropy.index_copy_(0, idx, _zero_unkept(ent_all[rows], real))
    out = (logprob, entropy) if plan.with_entropy else logprob
    return out, (max_all, sum_all, ent_all, *kept, *kept_max)


def _backward(saved, num_kept, plan: _Plan, need, grad_logprob, grad_entropy):
    hidden, weight, targets, rows_idx, row_mask, inv_t, max_all, sum_all, ent_all = saved[:9]
    kept, kept_max = saved[9 : 9 + num_kept], saved[9 + num_kept :]
    need_h, need_w = need
    cdtype = compute_dtype(hidden.dtype, weight.dtype)
    grad_h = torch.zeros_like(hidden, memory_format=torch.contiguous_format) if need_h else None
    if not (need_h or need_w) or rows_idx.numel() == 0:
        return grad_h, torch.zeros_like(weight) if need_w else None
    # The weight gradient accumulates over row chunks in the compute dtype (one rounding at the
    # end for a 16-bit weight). No zero fill: the first row chunk overwrites every tile of it
    # (beta=0 below). With a single row chunk there is nothing to accumulate: each tile is formed
    # in a tile buffer and rounded straight into a 16-bit gradient, so no [V, H] float32 buffer.
    direct_w = need_w and weight.dtype != cdtype and rows_idx.numel() <= plan.rows
    grad_w = weight.new_empty(weight.shape, dtype=None if direct_w else cdtype) if need_w else None
    # A missing upstream gradient is a zero gradient, never a dropped branch.
    n = hidden.shape[0]
    g_lp_all = _or_zeros(grad_logprob, n, hidden, cdtype)
    g_ent_all = _or_zeros(grad_entropy if plan.with_entropy else None, n, hidden, cdtype)
    if row_mask is not None:  # upstream gradients of ignored rows are dropped, NaN or not
        g_lp_all = _zero_unkept(g_lp_all, row_mask)
        g_ent_all = _zero_unkept(g_ent_all, row_mask)
    use_entropy = plan.with_entropy  # no all-zero skip: finding out would be a host sync
    buf, scratch, low_buf, wbuf = _buffers(hidden, weight, plan, cdtype)
    if direct_w and wbuf is None:  # native16: no upcast buffer to reuse for the tile
        wbuf = weight.new_empty(plan.vocab_tile * weight.shape[1], dtype=cdtype)
    vocab, tile_index = weight.shape[0], 0
    for start in range(0, rows_idx.numel(), plan.rows):
        idx = rows_idx[start : start + plan.rows]
        h = _masked_rows(hidden, idx, None if row_mask is None else row_mask.index_select(0, idx))
        inv = inv_t.index_select(0, idx) if inv_t is not None else plan.inv_temperature
        h_c = h if plan.native16 else h.to(cdtype)  # unscaled: the weight gradient's operand
        h_mm = h_c if plan.native16 else _scaled_rows(h_c, inv)
        rows = slice(start, start + plan.rows)
        row_max = max_all[rows].unsqueeze(1)
        inv_sum = sum_all[rows].reciprocal()
        g_lp = g_lp_all.index_select(0, idx) * inv
        g_ent = g_ent_all.index_select(0, idx) * inv
        # With s = z - m, e = exp(s), p = e / S and log p = s - log S, the tile gradient
        # G = p * (b * log p + c) = e * (b / S * s + (c - b * log S) / S), + g_lp at the target.
        b = -g_ent
        c = -(g_lp + g_ent * ent_all[rows]) if use_entropy else -g_lp
        if use_entropy:
            c = c - b * sum_all[rows].log()
        b, c = (b * inv_sum).unsqueeze(1), (c * inv_sum).unsqueeze(1)
        gh = h.new_empty(h.shape, dtype=cdtype) if need_h else None
        t = targets.index_select(0, idx)
        for j in range(0, vocab, plan.vocab_tile):
            w_tile = weight[j : j + plan.vocab_tile]
            recompute = tile_index >= len(kept)
            w_mm = w_tile
            if not plan.native16 and (recompute or need_h):
                w_mm = _as_compute(w_tile, wbuf)
            if recompute:
                z = _logits_tile(h_mm, w_mm, inv, buf, plan.native16)
                z.sub_(row_max)  # s
            else:  # z - m = (z - m_tile) - (m - m_tile), no matmul
                s_tile = kept[tile_index]
                shift = row_max - kept_max[tile_index].unsqueeze(1)
                z = torch.sub(s_tile, shift, out=buf[: s_tile.numel()].view_as(s_tile))
            tile_index += 1
            g = torch.exp(z, out=scratch[: z.numel()].view_as(z))  # e
            if use_entropy:
                g.mul_(torch.addcmul(c, z, b, out=z))
            else:
                g.mul_(c)
            _scatter_tile(g, t - j, g_lp)
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
                _addmm(grad_w[j : j + plan.vocab_tile], g_mm.T, h_c, overwrite=start == 0)
        if need_h:
            grad_h.index_copy_(0, idx, gh.to(hidden.dtype))
    return grad_h, _cast(grad_w, weight.dtype)


def _masked_rows(hidden: torch.Tensor, idx: torch.Tensor, keep: torch.Tensor | None):
    """``hidden[idx]``, with the rows ``keep`` marks False replaced by 0 (before any arithmetic:
    ``0 * NaN`` would still be NaN in the matmuls)."""
    h = hidden.index_select(0, idx)
    return h if keep is None else torch.where(keep.unsqueeze(1), h, 0.0)


def _zero_unkept(values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return values if keep is None else torch.where(keep, values, 0.0)


def _scatter_tile(g: torch.Tensor, local_targets: torch.Tensor, values: torch.Tensor) -> None:
    """``g[i, local_targets[i]] += values[i]`` for the targets inside this tile (O(rows) work)."""
    inside = (local_targets >= 0) & (local_targets < g.shape[1])
    index = local_targets.clamp(0, g.shape[1] - 1).unsqueeze(1)
    g.scatter_add_(1, index, torch.where(inside, values, 0.0).unsqueeze(1))


def _buffers(hidden: torch.Tensor, weight: torch.Tensor, plan: _Plan, cdtype: torch.dtype):
    """Flat tile buffers: logits and scratch (compute dtype); with ``native16`` a 16-bit copy of
    the gradient tile (the tensor-core operand); for a weight not in the compute dtype (and not
    ``native16``) room for one weight tile upcast to it."""
    size = plan.rows * plan.vocab_tile
    buf = hidden.new_empty(size, dtype=cdtype)
    scr = hidden.new_empty(size, dtype=cdtype)
    low = hidden.new_empty(size) if plan.native16 else None
    upcast = weight.dtype != cdtype and not plan.native16
    wbuf = weight.new_empty(plan.vocab_tile * weight.shape[1], dtype=cdtype) if upcast else None
    return buf, scr, low, wbuf


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


def _or_zeros(grad, n, like, dtype):
    if grad is None:
        return like.new_zeros(n, dtype=dtype)
    return grad.to(dtype)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def fused_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of an lm-head, without materialising the logits.

    ``log_softmax((hidden.float() @ weight.float().T) / temperature)`` gathered at ``targets``,
    and the entropy of that distribution, computed in float32 (float64 when an input is float64)
    whatever the input dtypes and autocast state: the logits are never rounded to 16 bits. Values
    equal those of :func:`microrl.kernels.reference_linear_logprob` (the eager definition) to the
    compute dtype's rounding, not bitwise. Gradients go to ``hidden`` and ``weight``, each only
    when it requires grad, in its own dtype. Full contract: ``docs/kernels.md``.

    Args:
        hidden: ``[..., H]`` float32/bfloat16/float16/float64, any strides.
        weight: ``[V, H]`` lm-head weight, any of those dtypes; it need not match ``hidden``'s
            (e.g. bf16 activations with a float32 weight): both are upcast to the compute dtype.
        targets: ``[...]`` integer ids in ``[0, V)``, or ``ignore_index``: those positions give
            log-prob 0 and entropy 0, and no gradient (their hidden rows are never read).
        temperature: float > 0, or a tensor broadcastable to ``targets.shape`` (per token / per
            row; no gradient flows to it).
        with_entropy: False returns ``None`` for the entropy and skips its passes.
        chunk_size: rows per chunk (at most; small problems use fewer); ``None`` uses 1024. It
            sets the vocabulary tile, ``WORKING_TILE_ELEMENTS // chunk_size`` columns (at least
            128, at most V), independently of the row count: extra memory is two compute-dtype
            working tiles plus two tiles kept from forward for backward (4 x 32 MiB in float32 by
            default, less for small problems), ``[rows, H]`` row copies and O(N) statistics,
            whatever N. A weight not in the compute dtype also gets a ``[vocab_tile, H]`` upcast
            buffer and, when it requires grad and there is more than one row chunk, a
            compute-dtype ``[V, H]`` gradient accumulator.
        ignore_index: target id that marks a position with no prediction.
        validate: True checks the target range and the temperature values on the device, with one
            device-to-host sync per call (which also counts the non-ignored rows, so only those
            are computed). False issues no sync at all (forward and backward), for callers in a
            hot loop that validated the values already, as the engine does for ``input_ids``
            against the vocabulary at the batch boundary. Only skip when every target is known to
            be in ``[0, V)`` or ``ignore_index`` and every temperature finite and > 0: otherwise
            the results are silently wrong (no error). It then computes every row, ignored ones
            included (masked, see the module docstring): same results, more work when many
            positions are ignored.

    Returns:
        ``(logprobs [...], entropy [...] | None)`` shaped like ``targets``, float32 (float64 when
        an input is float64).

    Raises:
        TypeError: ``hidden``, ``weight`` or ``targets`` not a tensor.
        ValueError: shape mismatch, ``weight`` not ``[V, H]``, non-float ``hidden``/``weight``,
            tensors on different devices, non-integer targets, temperature of a bad type or
            shape (or requiring grad), ``chunk_size < 1``, non-bool ``with_entropy``/``validate``,
            non-int ``ignore_index``; with ``validate``, also out-of-range targets and
            temperatures <= 0 or non-finite.
    """
    temp, count = check_linear_logprob_inputs(
        hidden, weight, targets, temperature, with_entropy, chunk_size, ignore_index, validate
    )
    # Flatten here, under autograd, so the Function receives tensors still connected to the graph.
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    valid = flat_targets != ignore_index
    flat_targets = torch.where(valid, flat_targets, 0)
    inv_t = (1.0 / temp).reshape(-1) if isinstance(temp, torch.Tensor) else None
    if count is None:  # no sync: every row, the ignored ones masked inside
        rows_idx = torch.arange(valid.numel(), device=valid.device)
        row_mask = valid
        if inv_t is not None:  # an ignored position's temperature is not validated: never use it
            inv_t = torch.where(valid, inv_t, 1.0)
    else:  # the count came with the validation's sync: compact without another one
        rows_idx = torch.nonzero_static(valid, size=count).squeeze(1)
        row_mask = None
    inv_scalar = 1.0 / temp if not isinstance(temp, torch.Tensor) else 1.0
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    native16 = _use_native16(hidden, weight)
    num_rows, vocab = max(1, rows_idx.numel()), weight.shape[0]
    plan = _plan(num_rows, vocab, chunk_size, with_entropy, inv_scalar, needs_grad, native16)
    out = _FusedLinearLogProb.apply(
        hidden_2d, weight, flat_targets, rows_idx, row_mask, inv_t, plan
    )
    if not with_entropy:
        return out.view(targets.shape), None
    logprobs, entropy = out
    return logprobs.view(targets.shape), entropy.view(targets.shape)
