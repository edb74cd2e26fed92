"""Shared fixtures.

``intra_op_threads`` runs a test once with 1 and once with 2 intra-op threads, whatever the
machine's core count, so tests of results that must not depend on how work is split (micro-batches,
packing, row counts) are proven under both: with 2 threads MKL/oneDNN split a GEMM differently for
different row counts, which changes float32 results by ~1e-7 relative (and fp64 by ~1e-16), never
more. Such tests compare within a tolerance stated next to the assertion, never bitwise.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def intra_op_threads(request: pytest.FixtureRequest):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(previous)
