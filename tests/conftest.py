"""The tests mirror the packages: tests/engine/ tests microrl.engine, tests/engine/parallel/
microrl.engine.parallel, tests/kernels/ microrl.kernels, and so on (each folder's conftest.py says
what it covers); ``test_imports.py`` here tests the top-level package (its API, the direction of
its imports) and the CI command; ``test_layout.py`` checks this layout.

Without ``__init__.py`` files, pytest puts each test's folder and this one on ``sys.path``: test
module and helper names are unique across folders. A test module never imports another one: what
tests share lives in a ``*_utils.py`` module. A helper one folder uses lives in it
(``kernel_utils``, ``loss_utils``, ``sync_utils``); those several folders use live here:
``engine_utils`` (tiny models, batches, references: engine, kernels, losses), ``distributed_utils``
(gloo rank launches: engine, kernels, losses, rollout; benchmarks/bench_tensor_parallel.py),
``export_utils`` (export checkers: engine and its subfolders), ``example_utils`` (tiny recipe
overrides, an example as a module: examples, run, tasks, losses, faults), ``model_reward_utils`` (a tiny
reward model, a stand-in judge server: tasks, examples), ``vlm_utils`` (a tiny vision-language
policy on the toy tokenizer, saved with its image processor: rollout, run). A file launched on ranks puts
tests/ on ``sys.path`` itself.

Shared fixtures (engine, kernels, losses).

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
