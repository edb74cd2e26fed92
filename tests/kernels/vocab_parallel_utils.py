"""What the two vocab-parallel kernel tests share (test_kernel_vocab_parallel.py and its
``_loss`` variant): a case's split and head variant, its inputs, and the tolerances per dtype
(that file's docstring derives them)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util

import torch

from microrl.kernels import _chunk_plan

# The GPU path's Triton kernels run (under Triton's interpreter) in the 2-rank launches only: a
# fresh process can set TRITON_INTERPRET before Triton is imported (test_triton_rows.py).
TRITON = importlib.util.find_spec("triton") is not None

B, T = 3, 5  # N = 15 rows
VALUE_TOL = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 2e-5)}
GRAD_ATOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def grad_atol(case) -> float:
    """``GRAD_ATOL`` of the case's compute dtype; 16-bit inputs on the GPU path: its 16-bit GEMMs
    take the logit gradient rounded to 16 bits (kernel_utils.GRAD_ATOL_16)."""
    if case.implementation != "auto" and case.dtype.itemsize == 2:
        return 2**-7
    return GRAD_ATOL[torch.float64 if case.dtype == torch.float64 else torch.float32]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    vocab: int  # the real V
    shard_rows: int  # rows of every rank's shard; rows at global index >= vocab are padding
    hidden: int = 16
    dtype: torch.dtype = torch.float64
    temperature: str = "scalar"  # "scalar" (0.7) | "token" ([B, T]) | "row" ([B, 1])
    ignore: bool = False  # some positions ignore_index (their hidden rows NaN)
    with_entropy: bool = True
    validate: bool = True
    chunk_size: int | None = None
    tiles: bool = False  # force several vocabulary tiles per shard
    need_h: bool = True
    need_w: bool = True
    bias: bool = False  # an lm-head bias, sharded like the weight (padding entries NaN)
    logit_scale: float = 1.0
    softcap: float | None = None
    implementation: str = "auto"  # "chunks"/"triton": the GPU path (on CPU tensors)

    def on(self, implementation: str) -> Case:
        """This case on another implementation, named after it."""
        return dataclasses.replace(
            self, name=f"{self.name}-{implementation}", implementation=implementation
        )


def make_inputs(case: Case, world: int, seed: int = 0):
    """hidden [B, T, H], full weight [world * shard_rows, H] (padding rows NaN), targets [B, T]
    (ignored positions -100, their hidden rows NaN), kernel kwargs. The same on every rank."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, case.hidden, generator=g, dtype=torch.float64)
    weight = torch.randn(world * case.shard_rows, case.hidden, generator=g, dtype=torch.float64)
    weight[case.vocab :] = torch.nan  # padding: must never be read
    targets = torch.randint(0, case.vocab, (B, T), generator=g)
    # The first and the last token are the extremes of the vocabulary (first and last shard).
    targets[0, 0], targets[0, 1] = 0, case.vocab - 1
    if case.ignore:
        targets[1, 2] = targets[2, 0] = -100
        hidden[1, 2] = hidden[2, 0] = torch.nan
    temperature = {
        "scalar": 0.7,
        "token": torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5,
        "row": torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.5,
    }[case.temperature]
    kwargs = dict(
        temperature=temperature,
        with_entropy=case.with_entropy,
        chunk_size=case.chunk_size,
        validate=case.validate,
        logit_scale=case.logit_scale,
        softcap=case.softcap,
    )
    if case.implementation != "auto":
        kwargs["implementation"] = case.implementation
    if case.bias:  # [world * shard_rows], like the weight; a bias of width 1 (a logit unit)
        bias = torch.randn(world * case.shard_rows, generator=g, dtype=torch.float64)
        bias[case.vocab :] = torch.nan
        kwargs["bias"] = bias.to(case.dtype)
    return hidden.to(case.dtype), weight.to(case.dtype), targets, kwargs


@contextlib.contextmanager
def gpu_path_tiles(case: Case):
    """For ``case.tiles`` on the GPU path: 4-row blocks by 64-column slices (a 150-row shard is
    64 + 64 + 22 columns), and a budget with no room for a whole row (the fused losses then
    recompute their tiles instead of keeping them)."""
    saved = _chunk_plan.plan_tiles, _chunk_plan.budget_bytes
    if case.tiles and case.implementation != "auto":

        def plan(problem, *, temps=0, **_):
            return _chunk_plan.ChunkPlan(4, 64, temps)

        _chunk_plan.plan_tiles, _chunk_plan.budget_bytes = plan, lambda m, v, h: 1
    try:
        yield
    finally:
        _chunk_plan.plan_tiles, _chunk_plan.budget_bytes = saved
