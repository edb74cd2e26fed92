"""Vocab-parallel fused lm-head log-prob / entropy: the vocabulary split over tensor-parallel ranks.

Each rank of a tensor-parallel group holds a ``[V_local, H]`` shard of the lm-head weight and the
same (replicated) ``hidden``, ``targets`` and temperature. Every rank gets the single-device
:func:`microrl.kernels.fused_linear_logprob` of the whole weight, to the compute dtype's
rounding, and no logits cross ranks: two collectives of O(N) statistics combine the shards. Both
upstream gradients are always materialised, which is the bug this module exists to avoid
(slime's Function dropped a branch whose gradient arrived as ``None``). The contract is
docs/kernels.md ("Vocab-parallel"); the math is its section "How the vocab-parallel kernel is
built".
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from . import linear_logprob
from ._checks import (
    HeadInputs,
    HeadSpec,
    check_linear_logprob_inputs,
    flatten,
    head_dtype,
    head_spec,
    no_autocast,
)
from ._dispatch import resolve
from ._tiles import (
    _cap_slope_,
    _cast,
    _gather_tile,
    _logits_tile,
    _masked_rows,
    _merge,
    _or_zeros,
    _row_affine,
    _row_factors,
    _scaled_rows,
    _scatter_tile,
    _softcap_,
    _take,
    _tile_stats,
    _zero_unkept,
)
from .chunked import VocabShard, chunked_linear_logprob, shard_hidden_grad

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._checks import HeadOptions


__all__ = ["vocab_parallel_linear_logprob"]

_shaped = linear_logprob._shaped

# Largest [rows, vocab_tile] logits tile, as in linear_logprob (32 MiB in float32): big tiles keep
# the number of elementwise ops (each an OpenMP region on a CPU) low.
_TILE_ELEMENTS = 8 * 1024 * 1024
_DEFAULT_ROWS = 1024
_MIN_VOCAB_TILE = 128  # thinner matmuls lose speed


@dataclass(frozen=True)
class _Plan:
    """Non-tensor arguments of the autograd Function: this rank's columns, the tiles and the
    call's checked ``HeadSpec``, bundled so backward returns few Nones."""

    shard: VocabShard  # group None: no tensor parallelism, no collective
    rows: int  # rows per chunk
    vocab_tile: int
    spec: HeadSpec


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)


def _rows_of(hidden, targets, inv_t, row_mask, plan, cdtype, rows, idx):
    """One chunk's rows in the compute dtype, unscaled and scaled by ``pre``, its local targets
    and the logit transform's factors ``(pre, post, dz)`` (``_row_factors``: ``pre = 1 / T``
    without a scale or cap)."""
    real = None if row_mask is None else _take(row_mask, rows, idx)
    h = _masked_rows(_take(hidden, rows, idx), real).to(cdtype)
    inv = _take(inv_t, rows, idx) if inv_t is not None else plan.spec.inv_temperature
    factors = _row_factors(inv, plan.spec.logit_scale, plan.spec.softcap)
    local_targets = _take(targets, rows, idx) - plan.shard.vocab_start
    return h, _scaled_rows(h, factors[0]), local_targets, factors


def _logits(h_mm, weight, bias, j, plan: _Plan, cdtype, buf, pre, post):
    """The shard's final logits of vocabulary tile ``j`` (bias, scale, cap and 1/T applied)."""
    w_c = weight[j : min(j + plan.vocab_tile, plan.shard.real_rows)].to(cdtype)
    b_tile = None if bias is None else bias[j : j + w_c.shape[0]].to(cdtype)
    z = _logits_tile(h_mm, w_c, pre, buf, False, b_tile)
    return (z if post is None else _softcap_(z, post)), w_c


def _local_stats(
    hidden, weight, bias, targets, rows_idx, row_mask, inv_t, plan: _Plan, cdtype, kept=None
):
    """Per processed row, the statistics of this shard's real rows: max ``m``, ``S``, ``A`` (or
    None) and the target logit (0 where the target is not in this shard).

    ``kept``: None, or ``(tiles, maxes, count)``: the first ``count`` tiles in loop order are left
    in buffers of their own, holding ``z - m_tile``, appended to ``tiles`` with their row maxes
    ``m_tile`` to ``maxes`` (what the single-device backward reuses instead of recomputing)."""
    m = hidden.shape[0] if rows_idx is None else rows_idx.numel()
    row_max = hidden.new_full((m,), -math.inf, dtype=cdtype)
    row_sum = hidden.new_zeros(m, dtype=cdtype)
    row_a = hidden.new_zeros(m, dtype=cdtype) if plan.spec.with_entropy else None
    target_logit = hidden.new_zeros(m, dtype=cdtype)
    if plan.shard.real_rows == 0 or m == 0:
        return row_max, row_sum, row_a, target_logit
    buf = hidden.new_empty(plan.rows * plan.vocab_tile, dtype=cdtype)
    scratch = hidden.new_empty(plan.rows * plan.vocab_tile, dtype=cdtype)
    for start in range(0, m, plan.rows):
        rows = slice(start, min(start + plan.rows, m))
        idx = None if rows_idx is None else rows_idx[rows]
        _, h_mm, t, (pre, post, _) = _rows_of(
            hidden, targets, inv_t, row_mask, plan, cdtype, rows, idx
        )
        picked = target_logit[rows]
        stats = None
        for j in range(0, plan.shard.real_rows, plan.vocab_tile):
            out = buf
            if kept is not None and len(kept[0]) < kept[2]:
                out = hidden.new_empty(plan.rows * plan.vocab_tile, dtype=cdtype)
            z, _ = _logits(h_mm, weight, bias, j, plan, cdtype, out, pre, post)
            _gather_tile(z, t - j, picked)
            tile = _tile_stats(z, scratch, plan.spec.with_entropy)
            stats = tile if stats is None else _merge(stats, tile)
            if out is not buf:
                kept[0].append(out)
                kept[1].append(tile[0])
        row_max[rows], row_sum[rows] = stats[0], stats[1]
        if plan.spec.with_entropy:
            row_a[rows] = stats[2]
    return row_max, row_sum, row_a, target_logit


def _combine(local, targets_local, shard: VocabShard):
    """Exact combination over ``shard``'s group: the global max first, then the rescaled sums.

    Returns the global per-row ``(m, S, A | None, z_t - m)``."""
    row_max, row_sum, row_a, target_logit = local
    m = row_max.clone()
    _all_reduce(m, dist.ReduceOp.MAX, shard.group)
    owned = (targets_local >= 0) & (targets_local < shard.real_rows)
    parts = [torch.where(owned, target_logit - m, 0.0)]
    if shard.real_rows == 0:  # m_r = -inf: nothing of this shard is in the softmax
        parts.append(torch.zeros_like(row_sum))
        if row_a is not None:
            parts.append(torch.zeros_like(row_a))
    else:
        d = row_max - m
        w = d.exp()
        parts.append(w * row_sum)
        if row_a is not None:
            parts.append(w * (row_a + d * row_sum))
    stacked = torch.stack(parts)
    _all_reduce(stacked, dist.ReduceOp.SUM, shard.group)
    shifted_target, total = stacked[0], stacked[1]
    return m, total, stacked[2] if row_a is not None else None, shifted_target


def _put(out: torch.Tensor, idx: torch.Tensor | None, values: torch.Tensor) -> None:
    if idx is None:
        out.copy_(values)
    else:
        out.index_copy_(0, idx, values)


class _VocabParallelLinearLogProb(torch.autograd.Function):
    # Never ctx.set_materialize_grads(False): an unused output's gradient must arrive as zeros
    # (and backward treats None as zeros anyway), or its branch is silently dropped.
    @staticmethod
    def forward(
        ctx: FunctionCtx, hidden, weight, bias, targets, rows_idx, row_mask, inv_t, plan: _Plan
    ):
        # hidden [N, H] (replicated), weight [V_local, H] (this rank's shard), bias [V_local] or
        # None, targets [N] global ids (ignored ones replaced by 0); rows_idx [M] rows to process
        # or None (all, in order); row_mask [N] bool (False: ignored, masked) or None; inv_t [N]
        # or None.
        cdtype = head_dtype(hidden, weight, bias)
        with no_autocast(hidden.device.type):
            local = _local_stats(
                hidden, weight, bias, targets, rows_idx, row_mask, inv_t, plan, cdtype
            )
            t_proc = targets if rows_idx is None else targets.index_select(0, rows_idx)
            t_local = t_proc - plan.shard.vocab_start
            m, total, a, shifted_target = _combine(local, t_local, plan.shard)
            log_sum = total.log()
            n = hidden.shape[0]
            new = hidden.new_empty if rows_idx is None else hidden.new_zeros
            logprob = new(n, dtype=cdtype)
            _put(logprob, rows_idx, _zero_unkept(shifted_target - log_sum, row_mask))
            entropy, ent = None, None
            if plan.spec.with_entropy:
                ent = log_sum - a / total
                entropy = new(n, dtype=cdtype)
                _put(entropy, rows_idx, _zero_unkept(ent, row_mask))
        ctx.save_for_backward(
            hidden, weight, bias, targets, rows_idx, row_mask, inv_t, m, total, ent
        )
        ctx.plan = plan
        return (logprob, entropy) if plan.spec.with_entropy else logprob

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprob, grad_entropy=None):
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        with no_autocast(saved[0].device.type):
            grad_h, grad_w, grad_b = _backward(saved, ctx.plan, need, grad_logprob, grad_entropy)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _backward(saved, plan: _Plan, need, grad_logprob, grad_entropy):
    hidden, weight, bias, targets, rows_idx, row_mask, inv_t, row_max, total, ent = saved
    need_h, need_w, need_b = need
    need_b = need_b and bias is not None
    cdtype = head_dtype(hidden, weight, bias)
    n = hidden.shape[0]
    m = n if rows_idx is None else rows_idx.numel()
    grad_w = weight.new_zeros(weight.shape, dtype=cdtype) if need_w else None  # padding rows: 0
    grad_b = bias.new_zeros(bias.shape, dtype=cdtype) if need_b else None  # column sums of G
    gh_all = hidden.new_zeros((m, hidden.shape[1]), dtype=cdtype) if need_h else None
    # A missing upstream gradient is a zero gradient, never a dropped branch.
    g_lp_all = _or_zeros(grad_logprob, n, hidden, cdtype)
    g_ent_all = _or_zeros(grad_entropy if plan.spec.with_entropy else None, n, hidden, cdtype)
    if row_mask is not None:  # upstream gradients of ignored rows are dropped, NaN or not
        g_lp_all = torch.where(row_mask, g_lp_all, 0.0)
        g_ent_all = torch.where(row_mask, g_ent_all, 0.0)
    if rows_idx is not None:
        g_lp_all = g_lp_all.index_select(0, rows_idx)
        g_ent_all = g_ent_all.index_select(0, rows_idx)
    if m > 0 and plan.shard.real_rows > 0 and (need_h or need_w or need_b):
        size = plan.rows * plan.vocab_tile
        buf, scratch = hidden.new_empty(size, dtype=cdtype), hidden.new_empty(size, dtype=cdtype)
        # Soft-capping with entropy: s = z - m goes next to tanh (kept for the slope).
        capped = plan.spec.softcap is not None and plan.spec.with_entropy
        shifted_buf = hidden.new_empty(size, dtype=cdtype) if capped else None
        log_sum = total.log()
        for start in range(0, m, plan.rows):
            rows = slice(start, min(start + plan.rows, m))
            idx = None if rows_idx is None else rows_idx[rows]
            h_c, h_mm, t, (pre, post, dz) = _rows_of(
                hidden, targets, inv_t, row_mask, plan, cdtype, rows, idx
            )
            # G is the gradient with respect to z = h @ W.T + b: the logits' gradient times
            # d logits / dz = scale / T, and the soft-capping slope 1 - tanh**2 per element.
            g_lp, g_ent = g_lp_all[rows] * dz, g_ent_all[rows] * dz
            # s = z - m, e = exp(s), p = e / S, log p = s - log S:
            # G = p (b log p + c) = e (b / S * s + (c - b log S) / S), plus g_lp / T at the target.
            inv_sum = total[rows].reciprocal()
            b = -g_ent
            c = -g_lp
            if plan.spec.with_entropy:
                c = c - g_ent * ent[rows] - b * log_sum[rows]
            b, c = (b * inv_sum).unsqueeze(1), (c * inv_sum).unsqueeze(1)
            shift = row_max[rows].unsqueeze(1)
            gh = gh_all[rows] if need_h else None
            for j in range(0, plan.shard.real_rows, plan.vocab_tile):
                z, w_c = _logits(h_mm, weight, bias, j, plan, cdtype, buf, pre, None)
                r, w = z.shape
                e = scratch[: r * w].view(r, w)
                if post is None:
                    s = z.sub_(shift)
                else:  # z keeps tanh for the slope; s = post * tanh - m beside it (or in e)
                    z.tanh_()
                    s = shifted_buf[: r * w].view(r, w) if capped else e
                    s = _row_affine(z, -row_max[rows], post, s)
                g = torch.exp(s, out=e)
                if plan.spec.with_entropy:
                    g.mul_(torch.addcmul(c, s, b, out=s))
                else:
                    g.mul_(c)
                _scatter_tile(g, t - j, g_lp)
                if post is not None:  # z holds tanh: the soft-capping slope 1 - tanh**2
                    g.mul_(_cap_slope_(z))
                if need_b:
                    grad_b[j : j + w] += g.sum(dim=0)
                if need_h:
                    gh.addmm_(g, w_c)
                if need_w:
                    grad_w[j : j + w].addmm_(g.T, h_c)
    grad_h = shard_hidden_grad(gh_all, hidden, rows_idx, plan.shard.group) if need_h else None
    grad_w = None if grad_w is None else grad_w.to(weight.dtype)
    return grad_h, grad_w, _cast(grad_b, bias.dtype if need_b else None)


def _is_dtensor(t) -> bool:
    """Without importing ``torch.distributed.tensor`` (1.5 s on a CPU): a DTensor exists only
    once that module has been imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _shard_of(weight, group, vocab_start, vocab_size):
    """``(local weight, group, vocab_start, vocab_size)`` from a DTensor or explicit arguments."""
    if _is_dtensor(weight):
        from torch.distributed.tensor import Shard

        if group is not None or vocab_start is not None:
            raise ValueError("group and vocab_start come from a DTensor weight: do not pass them")
        mesh = weight.device_mesh
        if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
            raise ValueError(
                "a DTensor weight must be sharded on dim 0 (Shard(0)) over a 1-D mesh, got "
                f"placements {tuple(weight.placements)} on a {mesh.ndim}-D mesh"
            )
        rows, coord = weight.shape[0], mesh.get_coordinate()[0]
        chunk = -(-rows // mesh.size())  # torch.chunk's split, as Shard(0) uses
        start = min(coord * chunk, rows)
        local = weight.to_local()  # differentiable: the gradient comes back as a Shard(0) DTensor
        if local.shape[0] != min(chunk, rows - start):
            raise ValueError(
                f"DTensor shard of {local.shape[0]} rows on mesh rank {coord} is not the even "
                f"Shard(0) split of {rows} rows"
            )
        vocab_size = rows if vocab_size is None else vocab_size
        if _not_int(vocab_size) or not 1 <= vocab_size <= rows:
            raise ValueError(f"vocab_size must be an int in [1, {rows}], got {vocab_size!r}")
        return local, mesh.get_group(0), start, vocab_size
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {group!r}")
    if _not_int(vocab_start) or vocab_start < 0:
        raise ValueError(f"vocab_start must be an int >= 0, got {vocab_start!r}")
    if _not_int(vocab_size) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    if group is None and (vocab_start != 0 or weight.shape[0] < vocab_size):
        raise ValueError(
            "group=None means no tensor parallelism: the weight must hold the whole vocabulary "
            f"(vocab_start=0, at least vocab_size={vocab_size} rows), got vocab_start="
            f"{vocab_start} and {weight.shape[0]} rows"
        )
    return weight, group, vocab_start, vocab_size


def _local_bias(bias, weight):
    """The local ``[V_local]`` bias: a DTensor bias must share the DTensor weight's mesh and
    ``Shard(0)`` layout (its ``to_local()`` is differentiable); a plain one goes with a plain
    weight."""
    if not _is_dtensor(bias) and not _is_dtensor(weight):
        return bias
    if bias is None:
        return None
    if not (_is_dtensor(bias) and _is_dtensor(weight)) or (
        bias.device_mesh != weight.device_mesh or bias.placements != weight.placements
    ):
        raise ValueError(
            "bias must be a DTensor on the weight's mesh with the weight's placements (Shard(0)) "
            "when the weight is a DTensor, and a plain tensor when it is not"
        )
    return bias.to_local()


def _not_int(x) -> bool:
    return isinstance(x, bool) or not isinstance(x, int)


def vocab_parallel_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    **head: Unpack[HeadOptions],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of an lm-head whose vocabulary is split over a TP group.

    Every rank of ``group`` gets ``fused_linear_logprob(hidden, full_weight, targets, ...)`` to the
    compute dtype's rounding, where ``full_weight`` is the concatenation of the ranks' shards
    without their padding rows. The forward communicates O(N) statistics (per row: a max, then
    a sum, the entropy term and the target logit), never logits. Full contract:
    ``docs/kernels.md`` ("Vocab-parallel"); the math: its "How the vocab-parallel kernel is built".

    Args:
        hidden: ``[..., H]`` float tensor, the same (replicated) on every rank of the group.
        weight: this rank's ``[V_local, H]`` shard: global vocabulary rows ``vocab_start ..
            vocab_start + V_local``. Rows at global index ``>= vocab_size`` are padding (an
            uneven split padded to equal shards, or a padded embedding): never read, gradient 0.
            Or a ``DTensor`` sharded ``Shard(0)`` over a 1-D mesh: ``group`` and ``vocab_start``
            then come from it (pass neither), ``vocab_size`` defaults to its global row count, and
            its gradient is a ``Shard(0)`` DTensor.
        targets: ``[...]`` global token ids in ``[0, vocab_size)`` or ``ignore_index``, replicated.
        group: the TP process group; ``None`` means no tensor parallelism (the weight must hold
            the whole vocabulary; nothing is communicated).
        vocab_start: global id of the shard's first row (required for a plain-tensor weight).
        vocab_size: the real (unpadded) vocabulary size V (required for a plain-tensor weight).
        temperature, with_entropy, chunk_size, ignore_index, validate: as in
            ``fused_linear_logprob`` (``validate=True`` checks targets against ``vocab_size``,
            with one host sync per call; ``chunk_size`` tiles the local shard).
        bias: None, or this rank's ``[V_local]`` slice of the lm-head bias (a ``Shard(0)``
            DTensor on the weight's mesh when the weight is one); its gradient stays local.
        logit_scale, softcap: as in ``fused_linear_logprob`` (elementwise on the logits, so
            each rank applies them to its own columns).
        implementation: as in ``fused_linear_logprob`` (CUDA tensors take the GPU path on the
            shard; every rank must take the same one).

    Returns:
        ``(logprobs [...], entropy [...] | None)``, identical on every rank, float32 (float64
        when an input is float64).

    Gradients: the hidden gradient returned is the **sum over the group** (the full gradient,
    the same on every rank: do not all-reduce it again); the weight gradient is the local shard's
    own (no communication). Every rank must backpropagate the same upstream gradients. A
    ``None`` upstream gradient (an unused output) counts as zeros: no branch is ever dropped.

    Raises:
        TypeError / ValueError: as ``fused_linear_logprob``, and for a bad ``group``,
            ``vocab_start``, ``vocab_size`` or DTensor layout, and a DTensor ``hidden``/``targets``.
    """
    spec, temperature, bias = head_spec("vocab_parallel_linear_logprob", head)
    spec, inputs, shard = checked_inputs(
        hidden, weight, targets, temperature, bias, spec, group, vocab_start, vocab_size
    )
    hidden_2d, weight, bias = inputs.hidden, inputs.weight, inputs.bias  # the shard's
    spec = resolve(hidden_2d, weight, bias, spec, "vocab_parallel_linear_logprob")
    if spec.implementation != "tiles":
        out = chunked_linear_logprob(inputs, spec, shard)
        return _shaped(out, targets.shape, spec.with_entropy)
    rows_idx, row_mask, inv_t = inputs.rows()
    configured = spec.chunk_size or _DEFAULT_ROWS
    num_rows = inputs.valid.numel() if rows_idx is None else rows_idx.numel()
    vocab_tile = max(1, min(shard.real_rows, max(_MIN_VOCAB_TILE, _TILE_ELEMENTS // configured)))
    plan = _Plan(shard, max(1, min(configured, num_rows)), vocab_tile, spec)
    out = _VocabParallelLinearLogProb.apply(
        hidden_2d, weight, bias, inputs.targets, rows_idx, row_mask, inv_t, plan
    )
    return _shaped(out, targets.shape, spec.with_entropy)


def checked_inputs(
    hidden, weight, targets, temperature, bias, spec: HeadSpec, group, vocab_start, vocab_size
) -> tuple[HeadSpec, HeadInputs, VocabShard]:
    """The vocab-parallel functions' checks and flattening: ``(checked spec, inputs with this
    rank's weight and bias, its shard)``; targets are checked against ``vocab_size``."""
    for name, t in (("hidden", hidden), ("targets", targets)):
        if _is_dtensor(t):
            raise ValueError(f"{name} must be a plain (replicated) tensor, not a DTensor")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    bias = _local_bias(bias, weight)
    weight, group, vocab_start, vocab_size = _shard_of(weight, group, vocab_start, vocab_size)
    # Shapes, dtypes, devices, flags, temperature form: the single-device checks (no sync). The
    # value checks below are against the whole vocabulary, not the shard.
    # A rank may hold no row at all (Shard(0) of fewer rows than ranks): the single-device
    # check refuses an empty weight, so it checks a one-row stand-in of the same dtype/device.
    empty = weight.dim() == 2 and weight.shape[0] == 0
    spec, per_token, _ = check_linear_logprob_inputs(
        hidden,
        weight.new_empty((1, weight.shape[1])) if empty else weight,
        targets,
        temperature,
        bias.new_empty(1) if empty and isinstance(bias, torch.Tensor) else bias,
        spec,
        values=False,
    )
    inputs = flatten(hidden, weight, bias, targets, per_token, spec, None)
    if spec.validate:
        wide = targets.reshape(-1).long()  # int8/uint8 comparisons wrap (uint8: -100 == 156)
        count = _validate_values(wide, inputs.valid, per_token, vocab_size, spec.ignore_index)
        inputs = inputs._replace(count=count)
    real_rows = max(0, min(weight.shape[0], vocab_size - vocab_start))
    return spec, inputs, VocabShard(group, vocab_start, real_rows)


def _validate_values(targets, valid, temp, vocab_size, ignore_index) -> int:
    """Targets in ``[0, vocab_size)`` or ignored, tensor temperatures finite and > 0, and the count
    of non-ignored rows: one host sync."""
    out_of_range = ((targets < 0) | (targets >= vocab_size)) & valid
    probes = [out_of_range.any(), valid.sum()]
    if isinstance(temp, torch.Tensor):
        bad_temp = ~(torch.isfinite(temp) & (temp > 0)).reshape(-1)
        probes.append((bad_temp & valid).any())  # an ignored position's temperature is unused
    summary = torch.stack([p.to(torch.float64) for p in probes]).tolist()  # the one sync
    if summary[0]:
        bad = targets[out_of_range][0].item()  # error path only
        raise ValueError(
            f"targets must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}, "
            f"found {bad}"
        )
    if len(summary) > 2 and summary[2]:
        raise ValueError("temperature must be finite and > 0 everywhere")
    return int(summary[1])
