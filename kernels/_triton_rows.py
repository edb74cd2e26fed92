"""The two row kernels of the chunked lm head in Triton: one program per row of a float32 logits
tile, reading it once.

``stats`` forms a row's softmax statistics over the tile (online max, ``sum exp``, and the
entropy's ``sum exp * (z - m)``) and merges them into the running ones; ``grads`` forms the
gradient with respect to the head's output ``x + b`` and writes it in the GEMM dtype, in place
over the tile when that is the output buffer (a 16-bit view of the float32 tile with the tile's
row stride in bytes: each program reads a column block before writing the same columns' 16-bit
values, which lie inside the bytes it has read, and rows never share bytes). Signatures and
arithmetic are those of the torch twins in ``kernels/_row_ops.py`` (their docstrings give the
formulas); the transform of the logits (bias, scale, soft-cap, temperature) is applied inside.

Row offsets are int64 (a tile of more than 2**31 elements would overflow int32 ones). The
soft-cap's ``tanh`` is written with ``exp`` (absolute error ~1e-7, like a float32 GEMM's
rounding of a logit), which also runs under ``TRITON_INTERPRET=1``, where the tests run these
kernels on CPU tensors (libdevice does not). No ``tl.dot``, no autotuning: block sizes are fixed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TEMPS", "grads", "stats"]

#: Tile-sized temporaries these kernels allocate: none.
TEMPS = 0
# Columns per loop step of a program, at most (a power of two).
_MAX_BLOCK = 4096
# Stands for -inf in the statistics (masked columns, no column yet): exp() of it is 0, and unlike
# -inf it gives 0, not NaN, when multiplied by a zero sum. A constexpr: a kernel may read no other
# global.
_NEG = tl.constexpr(-3.0e38)


@triton.jit
def _tanh(u):
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def _final_logits(x, b, inv, scale, cap, HAS_CAP: tl.constexpr):
    """``(z, tanh)``: the final logits of ``x + b``, and the tanh of the soft-cap (else ``u``)."""
    u = (x + b) * scale
    if HAS_CAP:
        t = _tanh(u / cap)
        z = t * (cap * inv)
    else:
        t = u
        z = u * inv
    return z, t


@triton.jit
def _block_logits(
    base, bias_ptr, start, n_cols, inv, scale, cap,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``(cols, mask, z, tanh)`` of a row's ``BLOCK`` columns from ``start`` (``_final_logits``;
    ``mask``: the columns below ``n_cols``, whose ``z`` is garbage elsewhere)."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(base + cols, mask=mask, other=0.0)
    b = tl.zeros((BLOCK,), tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=mask, other=0.0)
    z, t = _final_logits(x, b, inv, scale, cap, HAS_CAP)
    return cols, mask, z, t


@triton.jit
def _stats_kernel(
    tile_ptr, ld, n_cols, col0, tgt_ptr, inv_ptr, inv_scalar, bias_ptr, scale, cap,
    m_ptr, s_ptr, a_ptr, zt_ptr,
    FIRST: tl.constexpr, PER_ROW_T: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_CAP: tl.constexpr, WITH_ENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = tile_ptr + row * ld
    inv = inv_scalar
    if PER_ROW_T:
        inv = tl.load(inv_ptr + row)
    m_run = tl.full((), _NEG, tl.float32)
    s_run = tl.zeros((), tl.float32)
    a_run = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK):
        _cols, mask, z, _t = _block_logits(
            base, bias_ptr, start, n_cols, inv, scale, cap, HAS_BIAS, HAS_CAP, BLOCK
        )
        z = tl.where(mask, z, _NEG)
        m_new = tl.maximum(m_run, tl.max(z, 0))
        e = tl.exp(z - m_new)  # 0 on the masked columns
        alpha = tl.exp(m_run - m_new)  # 0 on the first block
        if WITH_ENT:
            shift = tl.where(s_run > 0, (m_run - m_new) * s_run, 0.0)
            a_run = alpha * (a_run + shift) + tl.sum(tl.where(mask, e * (z - m_new), 0.0), 0)
        s_run = alpha * s_run + tl.sum(e, 0)
        m_run = m_new
    t = tl.load(tgt_ptr + row) - col0
    if (t >= 0) & (t < n_cols):
        b_t = 0.0
        if HAS_BIAS:
            b_t = tl.load(bias_ptr + t)
        z_t, _t = _final_logits(tl.load(base + t), b_t, inv, scale, cap, HAS_CAP)
        tl.store(zt_ptr + row, z_t)
    if FIRST:
        tl.store(m_ptr + row, m_run)
        tl.store(s_ptr + row, s_run)
        if WITH_ENT:
            tl.store(a_ptr + row, a_run)
    else:  # merge with the running statistics of the earlier tiles (rescaled to the joint max)
        m_old = tl.load(m_ptr + row)
        s_old = tl.load(s_ptr + row)
        m_new = tl.maximum(m_old, m_run)
        w_old = tl.exp(m_old - m_new)
        w_run = tl.exp(m_run - m_new)
        tl.store(m_ptr + row, m_new)
        tl.store(s_ptr + row, w_old * s_old + w_run * s_run)
        if WITH_ENT:
            a_old = tl.load(a_ptr + row)
            a_new = w_old * (a_old + (m_old - m_new) * s_old) + w_run * (
                a_run + (m_run - m_new) * s_run
            )
            tl.store(a_ptr + row, a_new)


@triton.jit
def _grads_kernel(
    tile_ptr, ld, out_ptr, ld_out, n_cols, col0, tgt_ptr, inv_ptr, inv_scalar, bias_ptr, scale,
    cap, m_ptr, logs_ptr, gt_ptr, cc_ptr, bb_ptr,
    PER_ROW_T: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr,
    WITH_ENT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = tile_ptr + row * ld
    out_base = out_ptr + row * ld_out
    inv = inv_scalar
    if PER_ROW_T:
        inv = tl.load(inv_ptr + row)
    m = tl.load(m_ptr + row)
    log_s = tl.load(logs_ptr + row)
    g_t = tl.load(gt_ptr + row)
    cc = tl.load(cc_ptr + row)
    bb = 0.0
    if WITH_ENT:
        bb = tl.load(bb_ptr + row)
    t = tl.load(tgt_ptr + row) - col0
    for start in range(0, n_cols, BLOCK):
        cols, mask, z, th = _block_logits(
            base, bias_ptr, start, n_cols, inv, scale, cap, HAS_BIAS, HAS_CAP, BLOCK
        )
        s = z - m
        g = -tl.exp(s - log_s) * (cc + bb * s)
        g = tl.where(cols == t, g + g_t, g)
        if HAS_CAP:
            g = g * (1.0 - th * th)
        tl.store(out_base + cols, g.to(out_ptr.dtype.element_ty), mask=mask)


def _block(cols: int) -> int:
    return min(_MAX_BLOCK, triton.next_power_of_2(max(1, cols)))


def _per_row(inv_t, like: torch.Tensor):
    """``(pointer argument, scalar, per-row flag)`` of a temperature factor."""
    if isinstance(inv_t, torch.Tensor):
        return inv_t, 1.0, True
    return like, float(inv_t), False


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _launch(kernel, tile, inv_t, bias, scale, softcap, head: tuple, tail: tuple, **flags) -> None:
    """One program per row of ``tile`` (none when it is empty):
    ``kernel(*head, <temperature, bias, scale, cap>, *tail)`` with their flags, the block and
    ``flags``."""
    rows, cols = tile.shape
    if rows == 0 or cols == 0:
        return
    inv_arg, inv_scalar, per_row = _per_row(inv_t, tile)
    block = _block(cols)
    kernel[(rows,)](
        *head, inv_arg, inv_scalar, tile if bias is None else bias, float(scale),
        float(softcap or 1.0), *tail,
        PER_ROW_T=per_row, HAS_BIAS=bias is not None, HAS_CAP=softcap is not None, BLOCK=block,
        num_warps=_warps(block), **flags,
    )  # fmt: skip


def stats(tile, col0, targets, inv_t, bias, scale, softcap, m, s, a, zt, first) -> None:
    """``kernels/_row_ops.stats`` in one Triton launch (tile, statistics and targets on the
    device; the statistics float32)."""
    _launch(
        _stats_kernel, tile, inv_t, bias, scale, softcap,
        (tile, tile.stride(0), tile.shape[1], col0, targets), (m, s, s if a is None else a, zt),
        FIRST=bool(first), WITH_ENT=a is not None,
    )  # fmt: skip


def grads(tile, out, col0, targets, inv_t, bias, scale, softcap, m, log_s, g_t, cc, bb) -> None:
    """``kernels/_row_ops.grads`` in one Triton launch (``out`` may be a view of the tile's
    storage with the same byte offset per row, module docstring)."""
    _launch(
        _grads_kernel, tile, inv_t, bias, scale, softcap,
        (tile, tile.stride(0), out, out.stride(0), tile.shape[1], col0, targets),
        (m, log_s, g_t, cc, cc if bb is None else bb), WITH_ENT=bb is not None,
    )  # fmt: skip
