"""The tile plan of the chunked (GPU) lm head: its memory budget, its memory model and the
roofline cost model that picks the tile.

A tile is ``rows x cols`` float32 logits: ``rows`` of the processed tokens (a row block) by
``cols`` vocabulary columns. Forward runs one GEMM and one statistics kernel per tile; backward
recomputes the tile (a GEMM), forms its logit gradient in place and runs the two gradient GEMMs.
Which tile is best is a trade the roofline model settles: a tall block (many rows) makes the
weight-gradient GEMM compute-bound (it reads and writes its ``[cols, H]`` slice once per block)
and needs few roundings of a 16-bit weight gradient, a wide slice (many columns) does the same
for the hidden-gradient GEMM (its ``[rows, H]`` float32 accumulator is read and written once per
slice); the budget bounds ``rows x cols`` plus that accumulator. docs/kernels.md, "How the CUDA
path is built", gives the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "ChunkPlan",
    "Machine",
    "Problem",
    "budget_bytes",
    "extra_bytes",
    "plan_seconds",
    "plan_tiles",
]

# Smallest budget (bytes): tiny problems would be launch-bound below it.
MIN_BUDGET_BYTES = 8 * 1024 * 1024
# The share of Liger-Kernel's transient logits the budget takes (budget_bytes), as a fraction.
_BUDGET_SHARE = (7, 8)
# Columns of a slice narrower than the vocabulary are a multiple of this: aligned rows, and
# whole tensor-core tiles for the GEMMs.
COL_ALIGN = 128
# Fewest rows of a block the plan considers (the GEMMs get thin below).
MIN_ROWS = 16
# Blocks of equal height the plan tries: ceil(m / k) rows for each k here (and m // chunk_size).
_SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024)
# Within this fraction of the fastest plan, the one with the tallest blocks wins: fewer
# roundings of a 16-bit weight gradient, fewer weight reads.
_TIE = 0.03


@dataclass(frozen=True)
class Machine:
    """What the roofline model needs of a GPU: matmul peaks (16-bit and float32 inputs), memory
    bandwidth and the cost of one kernel launch. Spec-sheet peaks: the model ranks plans; it
    is no promise of the time."""

    name: str
    flops16: float  # FLOP/s, dense bf16/fp16 tensor cores
    flops32: float  # FLOP/s, float32 inputs (no TF32)
    bandwidth: float  # bytes/s of HBM
    launch: float = 4e-6  # seconds per kernel launch (the gap between back-to-back kernels)


H100 = Machine("H100 SXM", 989e12, 67e12, 3.35e12)
H200 = Machine("H200 SXM", 989e12, 67e12, 4.8e12)
# The plan is chosen for the machine with the least bandwidth per FLOP of the two: a plan that is
# compute-bound there is on the other too.
PLAN_MACHINE = H100


@dataclass(frozen=True)
class Sizes:
    """Bytes per element: hidden, weight, compute dtype (the logits), GEMM operands (2 when the
    GEMMs run on the 16-bit inputs with float32 output, else the compute dtype's)."""

    hidden: int
    weight: int
    compute: int
    gemm: int


@dataclass(frozen=True)
class Problem:
    """What a tile is planned for: ``m`` processed rows of a ``v``-column vocabulary, hidden size
    ``h``, bytes per element (``sizes``) and the gradients needed (hidden, weight, bias).
    ``bias``: the head has one; ``row_copies``: row blocks are gathered or masked copies
    (ignored rows); ``native16``: 16-bit GEMMs write float32 themselves (on a CPU they are
    emulated on upcast copies)."""

    m: int
    v: int
    h: int
    sizes: Sizes
    need: tuple[bool, bool, bool]
    bias: bool = False
    row_copies: bool = False
    native16: bool = True


@dataclass(frozen=True)
class ChunkPlan:
    """A tile of ``rows x cols`` logits. ``temps``: tile-sized temporaries of the row kernels
    (0 for the Triton ones, which work in registers; the torch twins allocate some)."""

    rows: int
    cols: int
    temps: int = 0


def budget_bytes(m: int, v: int, h: int) -> int:
    """Extra memory the chunked head may use for ``m`` rows, a ``v``-column vocabulary and hidden
    size ``h``: 7/8 of one float32 ``[ceil(m / ceil(v / h)), v]`` buffer, about ``3.5 * m * h``
    bytes.

    The buffer is Liger-Kernel's bound on its transient logits without its power-of-two
    rounding: Liger cuts the rows into chunks of ``next_pow2(ceil(m / ceil(v / h)))`` and holds
    two 16-bit ``[chunk, v]`` buffers at its backward's peak, so this is at most 7/8 of its extra
    memory; the eighth left is room for the allocator's rounding of each block (2 MiB on CUDA)."""
    per_chunk = -(-m // -(-v // max(1, h)))
    return max(MIN_BUDGET_BYTES, 4 * v * per_chunk * _BUDGET_SHARE[0] // _BUDGET_SHARE[1])


def extra_bytes(problem: Problem, plan: ChunkPlan) -> int:
    """Peak bytes the chunked head allocates beyond its inputs, outputs and returned gradients
    (the memory model; a test checks it against the allocations of a run)."""
    m, v, h, sizes, need = problem.m, problem.v, problem.h, problem.sizes, problem.need
    row_copies = problem.row_copies
    rows, cols = min(plan.rows, m), min(plan.cols, v)
    c = sizes.compute
    total = rows * cols * c * (1 + plan.temps)
    if sizes.gemm != sizes.hidden:  # the row block upcast for the GEMMs
        total += rows * h * c
    if sizes.gemm != sizes.weight:  # the weight slice upcast
        total += cols * h * c
    if sizes.gemm == 2 and not problem.native16:  # emulated 16-bit GEMMs: both operands upcast
        total += (rows + cols) * h * 4
    if row_copies:
        total += rows * h * sizes.hidden
    if need[0]:
        # The block's hidden gradient in the compute dtype: accumulated over the slices unless
        # that is the gradient itself, or one compute-dtype GEMM cast into a 16-bit gradient.
        in_place = sizes.hidden == c and not row_copies
        if (cols < v and not in_place) or (cols >= v and sizes.gemm != sizes.hidden):
            total += rows * h * c
    if need[1] and sizes.gemm != sizes.weight:  # weight-gradient slice formed, then cast
        total += cols * h * c
    if problem.bias:
        total += v * c * (2 if need[2] else 1)  # the bias in the compute dtype; its gradient
    # Per row: max, sum, entropy term, target logit, log-sum and entropy kept for backward, and
    # the three per-row factors of a gradient block; the flattened temperature and targets.
    return total + m * (c * 6 + 8 + 4) + rows * c * 3


def _tile_ops(problem: Problem, plan: ChunkPlan, keep: bool):
    """``(count, flops, bytes)`` of the average tile's ops, forward and backward (docstring of
    :func:`plan_seconds`)."""
    m, v, h, sizes, need = problem.m, problem.v, problem.h, problem.sizes, problem.need
    n_rows, n_cols = -(-m // plan.rows), -(-v // plan.cols)
    r, c = m / n_rows, v / n_cols
    g, cd = sizes.gemm, sizes.compute
    tiles = n_rows * n_cols
    gemm = (2 * r * c * h, (r + c) * h * g + r * c * cd)
    ops = [(tiles, *gemm), (tiles, 0, r * c * cd)]  # forward: logits GEMM, statistics kernel
    if not any(need):
        return ops
    if not keep:
        ops.append((tiles, *gemm))
    ops.append((tiles, 0, r * c * (cd + g)))  # the gradient kernel: float32 in, GEMM dtype out
    if need[0]:
        # Written once with one slice; else the float32 accumulator, read and written but on the
        # first slice.
        out = r * h * sizes.hidden if n_cols == 1 else r * h * cd * (2 - 1 / n_cols)
        ops.append((tiles, 2 * r * c * h, r * c * g + c * h * g + out))
    if need[1]:
        acc = c * h * sizes.weight * (2 - 1 / n_rows)  # read and written but on the first block
        ops.append((tiles, 2 * r * c * h, r * c * g + r * h * g + acc))
    if need[2]:
        ops.append((tiles, 0, r * c * g))
    return ops


def plan_seconds(
    problem: Problem, plan: ChunkPlan, machine: Machine = PLAN_MACHINE, *, keep: bool = False
) -> float:
    """Roofline time of forward + backward: per op, ``max(FLOPs / peak, bytes / bandwidth)`` plus
    a launch, summed over an average tile's ops times the number of tiles. ``keep``: the tile is
    kept from forward to the gradient pass (the fused loss), so backward runs no GEMM again."""
    flops = machine.flops16 if problem.sizes.gemm == 2 else machine.flops32
    total = 0.0
    for count, f, b in _tile_ops(problem, plan, keep):
        total += count * (max(f / flops, b / machine.bandwidth) + machine.launch)
    return total


def _candidate_rows(m: int, chunk_size: int | None) -> list[int]:
    tallest = min(m, chunk_size or m)
    first = -(-m // tallest)
    rows = {-(-m // k) for k in (first, *(first * s for s in _SPLITS))}
    return sorted((r for r in rows if r >= min(MIN_ROWS, tallest)), reverse=True)


def plan_tiles(
    problem: Problem, *, budget: int, chunk_size: int | None = None, temps: int = 0
) -> ChunkPlan:
    """The tile the roofline model (:func:`plan_seconds` on :data:`PLAN_MACHINE`) predicts
    fastest among those whose :func:`extra_bytes` fit ``budget``: blocks of equal height (at
    most ``chunk_size`` rows), slices as wide as the rest of the budget allows (a multiple of
    :data:`COL_ALIGN` columns, or the whole vocabulary). Near-ties go to the taller block. When
    nothing fits, the smallest tile (``MIN_ROWS x COL_ALIGN``)."""
    problem = replace(problem, m=max(1, problem.m), v=max(1, problem.v))
    m, v = problem.m, problem.v
    feasible = []  # (plan, seconds), tallest block first
    for rows in _candidate_rows(m, chunk_size):

        def model(cols, rows=rows):
            return extra_bytes(problem, ChunkPlan(rows, cols, temps))

        fixed = model(0)
        per_col = model(1) - fixed  # the model is linear in the columns below v
        cols = (budget - fixed) // per_col if budget > fixed else 0
        if cols < v:
            cols = cols // COL_ALIGN * COL_ALIGN
            if cols < COL_ALIGN:
                continue
        plan = ChunkPlan(rows, min(cols, v), temps)
        feasible.append((plan, plan_seconds(problem, plan)))
    if not feasible:
        return ChunkPlan(min(m, MIN_ROWS), min(v, COL_ALIGN), temps)
    fastest = min(seconds for _, seconds in feasible)
    return next(plan for plan, seconds in feasible if seconds <= fastest * (1 + _TIE))
