"""The two row kernels of the chunked lm head as torch ops: the ``"chunks"`` implementation (CUDA
without Triton, float64 on CUDA) and the twin the Triton kernels (``kernels/_triton_rows.py``)
are tested against. Same signatures, same arithmetic; these allocate tile-sized temporaries
(:data:`TEMPS`), the Triton kernels none.

A tile is ``x = h @ W_slice.T`` (``[r, c]`` in the compute dtype) for the columns
``col0 .. col0 + c`` of the (local) vocabulary. Its final logits are
``z = post * tanh(pre * (x + b))`` with a soft-cap, ``pre * (x + b)`` without
(``_tiles._row_factors``: ``pre = scale / T`` without a cap).
"""

from __future__ import annotations

import torch

from ._tiles import _gather_tile, _merge, _mul_rows_, _row_affine, _row_factors, _tile_stats

__all__ = ["TEMPS", "grads", "stats"]

#: Tile-sized temporaries these ops allocate at once (the plan budgets for them).
TEMPS = 3


def _pre_logits(tile: torch.Tensor, bias: torch.Tensor | None, pre) -> torch.Tensor:
    """``pre * (x + b)`` in a new tile."""
    u = tile + bias if bias is not None else tile.clone()
    return _mul_rows_(u, pre)


def stats(tile, col0, targets, inv_t, bias, scale, softcap, m, s, a, zt, first) -> None:
    """Merge the tile's row statistics into the running ones, in place: ``m`` max, ``s = sum
    exp(z - m)``, ``a = sum exp(z - m) (z - m)`` (None: no entropy), and ``zt`` the final logit
    of each row's target where it lies in this tile (``targets`` are vocabulary ids; others are
    left as they are). ``first``: overwrite instead of merging."""
    pre, post, _ = _row_factors(inv_t, scale, softcap)
    z = _pre_logits(tile, bias, pre)
    if post is not None:
        _mul_rows_(z.tanh_(), post)
    _gather_tile(z, targets - col0, zt)
    tile_stats = _tile_stats(z, torch.empty_like(z).view(-1), a is not None)
    merged = tile_stats if first else _merge((m, s, a), tile_stats)
    m.copy_(merged[0])
    s.copy_(merged[1])
    if a is not None:
        a.copy_(merged[2])


def grads(tile, out, col0, targets, inv_t, bias, scale, softcap, m, log_s, g_t, cc, bb) -> None:
    """The gradient with respect to ``x + b`` of the tile, written into ``out`` (its dtype; it
    may share the tile's storage). Per row: ``m`` and ``log_s`` the row's (global) max and log
    of ``sum exp(z - m)``, and the coefficients (all times ``k = scale / T``, the slope of the
    final logit without a cap) ``g_t = k g_lp``, ``cc = k (g_lp + g_H (H - log_s))`` and
    ``bb = k g_H`` (None: no entropy):

    ``out_j = (g_t [j == target] - exp(s_j - log_s) (cc + bb s_j)) * (1 - tanh_j**2)``,
    ``s_j = z_j - m`` (the last factor only with a soft-cap)."""
    pre, post, _ = _row_factors(inv_t, scale, softcap)
    u = _pre_logits(tile, bias, pre)
    if post is not None:  # u keeps tanh for the slope; s = post * tanh - m beside it
        u.tanh_()
        s = _row_affine(u, -m, post, torch.empty_like(u))
    else:
        s = u.sub_(m.unsqueeze(1))
    g = (s - log_s.unsqueeze(1)).exp_()
    # s is dead after this: the factor cc + bb s goes in its place.
    factor = s.mul_(bb.unsqueeze(1)).add_(cc.unsqueeze(1)) if bb is not None else cc.unsqueeze(1)
    g.mul_(factor).neg_()
    inside = (targets >= col0) & (targets < col0 + g.shape[1])
    index = (targets - col0).clamp(0, g.shape[1] - 1).unsqueeze(1)
    g.scatter_add_(1, index, torch.where(inside, g_t, 0.0).unsqueeze(1))
    if post is not None:  # the soft-cap's slope 1 - tanh**2, in u's place
        g.mul_(u.mul_(u).neg_().add_(1.0))
    out.copy_(g)
