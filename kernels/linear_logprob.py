"""Fused lm-head log-prob / entropy: ``hidden @ weight.T`` -> per-token log-prob and entropy.

The full ``[N, V]`` logits are never materialised. Rows are processed in chunks of ``rows`` tokens
and the vocabulary in tiles of ``vocab_tile`` columns, so the working set is one ``[rows,
vocab_tile]`` logits tile plus one scratch tile of the same size (and ``_KEPT_TILES`` tiles held
for backward), independent of N.

Forward, per row chunk: for each vocabulary tile, ``z = (h / T) @ W_tile.T`` (one matmul in the
input dtype, upcast to float32), the tile's logsumexp and entropy, merged into running per-row
statistics with the max-rescaled (online) logsumexp, so every value stays finite for huge logits
and for rows whose logits are all very negative. Statistics are kept as (max ``m``, ``S = sum
exp(z - m)``), never as a rounded ``lse``: ``z - m`` is exact near the max, which keeps float32
results for logits of size 1e4 as accurate as the eager reference. The target logit is gathered
from its tile. Only O(N) statistics are saved for backward: per-row ``m``, ``S`` and entropy.

Backward recomputes each logits tile (one more matmul) instead of keeping ``[N, V]`` of them from
the forward: keeping would cost 6*N*H*V flops instead of 8*N*H*V, but memory that grows with N.
Upstream gradients are unknown in forward, so the gradient cannot be formed there either. The
middle ground taken: the forward keeps a fixed number of tiles (``_KEPT_TILES``, as ``z - m_tile``)
whose recompute backward then skips, so memory stays flat in N (7.5*N*H*V flops at N=2048,
V=32768 instead of 8). The extra matmul is paid back on a CPU by the elementwise work: about ten passes over each
tile in all, against ~25 passes over full ``[N, V]`` buffers (plus page faults) in eager autograd.
With ``z`` the tempered logits, ``p = softmax(z)``, ``H`` the entropy and upstream gradients
``g_lp``, ``g_H`` per row, the gradient with respect to the untempered logits is::

    dL/dlogit_j = (g_lp * [j == target] - p_j * (g_lp + g_H * (log p_j + H))) / T

(``dH/dz_j = -p_j (log p_j + H)``), computed in place on the tile in four elementwise passes
(``z - m``, ``exp``, the per-row affine factor, the product; the ``[j == target]`` term is an
O(rows) scatter) and followed by ``grad_hidden += G @ W_tile`` and ``grad_weight[tile] += G.T @
h``, each skipped when ``ctx.needs_input_grad`` says that input does not need a gradient (a frozen
weight gets no ``[V, H]`` buffer and no matmul). Upstream gradients stay materialised (a missing
one arrives as zeros), so no branch can be dropped; with ``with_entropy`` the entropy passes always
run (skipping them for an all-zero entropy gradient would need a host sync to find out).

Ignored rows (``ignore_index``): with ``validate=True`` the one host sync of the input check also
reads their count, and the non-ignored rows are compacted (``nonzero_static``): ignored rows are
never read, their outputs and gradients are zero. With ``validate=False`` (no host sync at all, for
the engine's micro-batch loop, design.md section 6) every row is processed and the ignored ones are
masked with ``torch.where`` before any arithmetic: hidden row and temperature replaced (by 0 and 1),
target by 0, upstream gradients and outputs by 0, so garbage (NaN/inf) there cannot leak anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from ._checks import check_linear_logprob_inputs, compute_dtype

__all__ = ["WORKING_TILE_ELEMENTS", "fused_linear_logprob"]

# Elements of one [rows, vocab_tile] logits tile. Two such float32 tiles (logits + scratch) are
# the extra working memory for the logits: 2 * 4 * 2**23 bytes = 64 MiB whatever N (eager holds
# several [N, V] buffers: ~1.3 GB at N=2048, V=32768). Why not cache-sized tiles: every
# elementwise op is one OpenMP region whose barrier costs up to a scheduler slice on a busy CPU;
# 2 MiB tiles meant ~2000 regions per step and ran 2-3x slower there, 32 MiB tiles ~120.
WORKING_TILE_ELEMENTS = 8 * 1024 * 1024
# Small problems are cut into at least this many tiles, so the four tile-sized buffers (two
# working, two kept) stay within half of one [N, V] logits buffer, i.e. ~10% of what eager
# holds, at any size; the floor keeps tiny problems from becoming op-overhead bound.
_MIN_TILES = 8
_MIN_TILE_ELEMENTS = 64 * 1024
# Default rows per chunk: W is streamed once per chunk and per pass, so taller chunks amortise
# it over more tokens (measured ~4% faster than 512 on this CPU); the tile stays fixed anyway.
_DEFAULT_ROWS = 1024
# Narrowest vocabulary tile when a caller asks for very tall chunks: thinner matmuls lose speed.
_MIN_VOCAB_TILE = 128
# Logits tiles the forward keeps for backward instead of recomputing them (when a gradient will be
# needed): each saves one tile matmul (1/4 of that tile's flops) for one tile of memory. A fixed
# count, so the extra memory stays (2 + 2) tiles = 128 MiB in float32 whatever N; larger problems
# simply recompute a larger share.
_KEPT_TILES = 2


@dataclass(frozen=True)
class _Plan:
    """Non-tensor arguments of the autograd Function, bundled so backward returns few Nones."""

    rows: int
    vocab_tile: int
    with_entropy: bool
    inv_temperature: float  # used when no per-token temperature tensor is given
    kept_tiles: int  # logits tiles saved by forward for backward (0 when no gradient is needed)


def _plan(
    num_rows: int,
    vocab: int,
    chunk_size: int | None,
    with_entropy: bool,
    inv: float,
    needs_grad: bool = True,
) -> _Plan:
    rows = max(1, min(chunk_size or _DEFAULT_ROWS, num_rows))
    small = max(_MIN_TILE_ELEMENTS, -(-num_rows * vocab // _MIN_TILES))
    tile_elements = min(WORKING_TILE_ELEMENTS, small)
    vocab_tile = min(vocab, max(_MIN_VOCAB_TILE, tile_elements // rows))
    return _Plan(rows, vocab_tile, with_entropy, inv, _KEPT_TILES if needs_grad else 0)


def _scaled_rows(h: torch.Tensor, inv: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``h / T`` for matmuls in the input dtype; low-precision inputs are scaled after the upcast
    (as the reference does), so they return ``h`` unchanged."""
    if h.dtype != dtype:
        return h
    if isinstance(inv, torch.Tensor):
        return h * inv.unsqueeze(1)
    return h * inv if inv != 1.0 else h


def _logits_tile(h_s, w_tile, inv, buf, low_buf):
    """``[r, w]`` tempered logits of one tile in the compute dtype, written into ``buf``."""
    r, w = h_s.shape[0], w_tile.shape[0]
    z = buf[: r * w].view(r, w)
    if low_buf is None:
        return torch.mm(h_s, w_tile.T, out=z)
    low = torch.mm(h_s, w_tile.T, out=low_buf[: r * w].view(r, w))
    if isinstance(inv, torch.Tensor):
        return torch.mul(low, inv.unsqueeze(1), out=z)
    z.copy_(low)  # upcast first: a Python-float factor would keep the product in low precision
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
        cdtype = compute_dtype(hidden.dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        logprob = hidden.new_zeros(n, dtype=cdtype)
        entropy = hidden.new_zeros(n, dtype=cdtype) if plan.with_entropy else None
        m = rows_idx.numel()
        max_all = hidden.new_empty(m, dtype=cdtype)
        sum_all = hidden.new_empty(m, dtype=cdtype)
        ent_all = hidden.new_empty(m, dtype=cdtype) if plan.with_entropy else None
        buf, scratch, low_buf = _buffers(hidden, plan, cdtype)
        kept, kept_max = [], []  # tiles holding z - m_tile, and m_tile, in loop order
        for start in range(0, m, plan.rows):
            idx = rows_idx[start : start + plan.rows]
            rows = slice(start, start + plan.rows)
            inv = inv_t.index_select(0, idx) if inv_t is not None else plan.inv_temperature
            real = None if row_mask is None else row_mask.index_select(0, idx)
            h_s = _scaled_rows(_masked_rows(hidden, idx, real), inv, cdtype)
            t = targets.index_select(0, idx)
            target_logit = hidden.new_zeros(idx.numel(), dtype=cdtype)
            stats = None
            for j in range(0, vocab, plan.vocab_tile):
                keep = len(kept) < plan.kept_tiles
                out = hidden.new_empty(buf.numel(), dtype=cdtype) if keep else buf
                z = _logits_tile(h_s, weight[j : j + plan.vocab_tile], inv, out, low_buf)
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
        ctx.save_for_backward(
            hidden, weight, targets, rows_idx, row_mask, inv_t, max_all, sum_all, ent_all,
            *kept, *kept_max,
        )  # fmt: skip
        ctx.plan = plan
        ctx.num_kept = len(kept)
        return (logprob, entropy) if plan.with_entropy else logprob

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprob, grad_entropy=None):
        saved = ctx.saved_tensors
        hidden, weight, targets, rows_idx, row_mask, inv_t, max_all, sum_all, ent_all = saved[:9]
        kept, kept_max = saved[9 : 9 + ctx.num_kept], saved[9 + ctx.num_kept :]
        plan: _Plan = ctx.plan
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cdtype = compute_dtype(hidden.dtype)
        grad_h = torch.zeros_like(hidden, memory_format=torch.contiguous_format) if need_h else None
        if not (need_h or need_w) or rows_idx.numel() == 0:
            grad_w = torch.zeros_like(weight) if need_w else None
            return grad_h, grad_w, None, None, None, None, None
        # Low-precision weights accumulate their gradient in float32 (one rounding at the end).
        # No zero fill: the first row chunk overwrites every tile of it (beta=0 below).
        grad_w = weight.new_empty(weight.shape, dtype=cdtype) if need_w else None
        # A missing upstream gradient is a zero gradient, never a dropped branch.
        g_lp_all = _or_zeros(grad_logprob, hidden.shape[0], hidden, cdtype)
        g_ent_all = _or_zeros(
            grad_entropy if plan.with_entropy else None, hidden.shape[0], hidden, cdtype
        )
        if row_mask is not None:  # upstream gradients of ignored rows are dropped, NaN or not
            g_lp_all = _zero_unkept(g_lp_all, row_mask)
            g_ent_all = _zero_unkept(g_ent_all, row_mask)
        use_entropy = plan.with_entropy  # no all-zero skip: finding out would be a host sync
        buf, scratch, low_buf = _buffers(hidden, plan, cdtype)
        vocab, tile_index = weight.shape[0], 0
        for start in range(0, rows_idx.numel(), plan.rows):
            idx = rows_idx[start : start + plan.rows]
            h = _masked_rows(
                hidden, idx, None if row_mask is None else row_mask.index_select(0, idx)
            )
            inv = inv_t.index_select(0, idx) if inv_t is not None else plan.inv_temperature
            h_s = _scaled_rows(h, inv, cdtype)
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
                if tile_index < len(kept):  # z - m = (z - m_tile) - (m - m_tile), no matmul
                    s_tile = kept[tile_index]
                    shift = row_max - kept_max[tile_index].unsqueeze(1)
                    z = torch.sub(s_tile, shift, out=buf[: s_tile.numel()].view_as(s_tile))
                else:
                    z = _logits_tile(h_s, w_tile, inv, buf, low_buf)
                    z.sub_(row_max)  # s
                tile_index += 1
                g = torch.exp(z, out=scratch[: z.numel()].view_as(z))  # e
                if use_entropy:
                    g.mul_(torch.addcmul(c, z, b, out=z))
                else:
                    g.mul_(c)
                _scatter_tile(g, t - j, g_lp)
                g_mm = g if low_buf is None else low_buf[: g.numel()].view_as(g).copy_(g)
                if need_h:
                    _addmm(gh, g_mm, w_tile, overwrite=j == 0)
                if need_w:
                    _addmm(grad_w[j : j + plan.vocab_tile], g_mm.T, h, overwrite=start == 0)
            if need_h:
                grad_h.index_copy_(0, idx, gh.to(hidden.dtype))
        return grad_h, _cast(grad_w, weight.dtype), None, None, None, None, None


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


def _buffers(hidden: torch.Tensor, plan: _Plan, cdtype: torch.dtype):
    """Flat tile buffers: logits (compute dtype), scratch, and a low-precision matmul output."""
    size = plan.rows * plan.vocab_tile
    buf = hidden.new_empty(size, dtype=cdtype)
    scr = hidden.new_empty(size, dtype=cdtype)
    low = hidden.new_empty(size) if hidden.dtype != cdtype else None
    return buf, scr, low


def _addmm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool) -> None:
    """``acc += a @ b`` (``acc = a @ b`` when ``overwrite``: uninitialised ``acc`` is ignored) with
    ``acc`` in the compute dtype and ``a``, ``b`` in the input dtype."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=0.0 if overwrite else 1.0)
    elif overwrite:
        acc.copy_(torch.mm(a, b))
    else:
        acc += torch.mm(a, b)


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

    Exactly ``log_softmax((hidden @ weight.T).float() / temperature)`` gathered at ``targets``,
    and the entropy of that distribution, with gradients to ``hidden`` and ``weight`` (each only
    when it requires grad). See :func:`microrl.kernels.reference_linear_logprob` for the eager
    definition.

    Args:
        hidden: ``[..., H]`` float32/bfloat16/float16/float64, any strides.
        weight: ``[V, H]`` lm-head weight (same dtype as ``hidden``).
        targets: ``[...]`` integer ids in ``[0, V)``, or ``ignore_index``: those positions give
            log-prob 0 and entropy 0, and no gradient (their hidden rows are never read).
        temperature: float > 0, or a tensor broadcastable to ``targets.shape`` (per token / per
            row; no gradient flows to it).
        with_entropy: False returns ``None`` for the entropy and skips its passes.
        chunk_size: rows per chunk; ``None`` uses 1024. The vocabulary tile is then chosen so a
            ``[rows, vocab_tile]`` tile holds ``WORKING_TILE_ELEMENTS`` elements (at least 128
            columns): extra memory is two such compute-dtype working tiles plus two tiles kept
            from forward for backward (4 x 32 MiB in float32), ``[rows, H]`` row copies and O(N)
            statistics, whatever N. A low-precision weight that requires grad also gets a
            float32 ``[V, H]`` gradient accumulator.
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
        ``(logprobs [...], entropy [...] | None)`` shaped like ``targets``, float32 (float64 for
        float64 inputs).

    Raises:
        ValueError: shape mismatch, ``weight`` not ``[V, H]``, non-integer targets, temperature
            of a bad type or shape, ``chunk_size < 1``; with ``validate``, also out-of-range
            targets and temperatures <= 0 or non-finite.
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
    plan = _plan(
        max(1, rows_idx.numel()), weight.shape[0], chunk_size, with_entropy, inv_scalar, needs_grad
    )
    out = _FusedLinearLogProb.apply(
        hidden_2d, weight, flat_targets, rows_idx, row_mask, inv_t, plan
    )
    if not with_entropy:
        return out.view(targets.shape), None
    logprobs, entropy = out
    return logprobs.view(targets.shape), entropy.view(targets.shape)
