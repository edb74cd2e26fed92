"""Row and tile helpers of the fused lm-head kernels (``linear_logprob``, ``vocab_parallel``):
pure tensor functions.

The logits tile itself (the head matmul with its bias), the online (max-rescaled) softmax
statistics of a tile and their merge, the target gather/scatter, row selection and masking, and
the logit transform that follows the head matmul (scale, soft-capping) with its gradient factor.
None of them allocates a tile: they work in the buffers the kernels hand them. The contract is in ``docs/kernels.md``.
"""

from __future__ import annotations

import torch


def _scaled_rows(h: torch.Tensor, inv: torch.Tensor | float) -> torch.Tensor:
    """``h / T`` in the compute dtype: folded into the rows, it saves a pass over every tile."""
    if isinstance(inv, torch.Tensor):
        return h * inv.unsqueeze(1)
    return h * inv if inv != 1.0 else h


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


def _take(t: torch.Tensor, rows: slice, idx: torch.Tensor | None) -> torch.Tensor:
    """The rows of one chunk: a view when every row is processed in order, else gathered."""
    return t[rows] if idx is None else t.index_select(0, idx)


def _put(out: torch.Tensor, rows: slice, idx: torch.Tensor | None, values: torch.Tensor) -> None:
    if idx is None:
        out[rows] = values
    else:
        out.index_copy_(0, idx, values)


def _masked_rows(h: torch.Tensor, keep: torch.Tensor | None):
    """Rows ``h`` with those ``keep`` marks False replaced by 0 (before any arithmetic: ``0 * NaN``
    would still be NaN in the matmuls)."""
    return h if keep is None else torch.where(keep.unsqueeze(1), h, 0.0)


def _zero_unkept(values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return values if keep is None else torch.where(keep, values, 0.0)


def _scatter_tile(g: torch.Tensor, local_targets: torch.Tensor, values: torch.Tensor) -> None:
    """``g[i, local_targets[i]] += values[i]`` for the targets inside this tile (O(rows) work)."""
    inside = (local_targets >= 0) & (local_targets < g.shape[1])
    index = local_targets.clamp(0, g.shape[1] - 1).unsqueeze(1)
    g.scatter_add_(1, index, torch.where(inside, values, 0.0).unsqueeze(1))


def _or_zeros(grad, n, like, dtype):
    if grad is None:
        return like.new_zeros(n, dtype=dtype)
    return grad.to(dtype)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _times(x: torch.Tensor | float, k: float) -> torch.Tensor | float:
    """``x * k`` for a per-row tensor or a float, skipping a multiplication by 1."""
    return x if k == 1.0 else x * k


def _row_factors(inv: torch.Tensor | float, scale: float, softcap: float | None):
    """Per-row (``[r]`` tensors) or scalar factors of the logit transform of one row chunk.

    The logits of a row are ``post * tanh(pre * z)`` with soft-capping and ``pre * z`` without,
    ``z = h @ W.T + b`` the head's output: ``pre = scale / c`` and ``post = c / T`` with a cap
    ``c``, ``pre = scale / T`` without. ``grad = scale / T`` is ``d logits / d z`` but for the
    soft-capping slope ``1 - tanh(pre * z)**2``, which is applied per element."""
    grad = _times(inv, scale)
    if softcap is None:
        return grad, None, grad
    return scale / softcap, _times(inv, softcap), grad


def _mul_rows_(z: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """``z *= factor`` in place, ``factor`` a per-row ``[r]`` tensor or a float."""
    if isinstance(factor, torch.Tensor):
        return z.mul_(factor.unsqueeze(1))
    return z.mul_(factor) if factor != 1.0 else z


def _row_affine(x: torch.Tensor, shift: torch.Tensor, k: torch.Tensor | float, out: torch.Tensor):
    """``out = shift[:, None] + k * x`` in one pass, ``k`` a per-row ``[r]`` tensor or a float."""
    if isinstance(k, torch.Tensor):
        return torch.addcmul(shift.unsqueeze(1), x, k.unsqueeze(1), out=out)
    return torch.add(shift.unsqueeze(1), x, alpha=k, out=out)


def _softcap_(u: torch.Tensor, post: torch.Tensor | float) -> torch.Tensor:
    """``u -> post * tanh(u)`` in place: the soft-capped, tempered logits from ``u = pre * z``."""
    return _mul_rows_(u.tanh_(), post)


def _cap_slope_(t: torch.Tensor) -> torch.Tensor:
    """``t -> 1 - t**2`` in place, one pass: the derivative of ``tanh`` at ``tanh = t``."""
    return torch.addcmul(t.new_ones(()), t, t, value=-1.0, out=t)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` for 16-bit ``a``, ``b`` with float32 accumulation and float32 ``out``."""
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def _logits_tile(h_mm, w_mm, pre, buf, native16, bias=None):
    """``[r, w]`` tile ``pre * (h @ W_tile.T + b_tile)`` in the compute dtype, written into
    ``buf`` (the tempered logits unless soft-capping follows, see ``_row_factors``): from rows
    already multiplied by ``pre`` and a weight tile, both in the compute dtype (the bias term
    ``pre * b`` is written first and the product accumulated onto it), or (``native16``) from the
    16-bit inputs, with float32 output, then ``+ b`` and ``* pre``."""
    r, w = h_mm.shape[0], w_mm.shape[0]
    z = buf[: r * w].view(r, w)
    if not native16:
        if bias is None:
            return torch.mm(h_mm, w_mm.T, out=z)
        factor = pre.unsqueeze(1) if isinstance(pre, torch.Tensor) else pre
        torch.mul(bias.expand(r, w), factor, out=z)
        return z.addmm_(h_mm, w_mm.T)
    _mm_fp32(h_mm, w_mm.T, z)
    if bias is not None:
        z.add_(bias)
    return _mul_rows_(z, pre)
