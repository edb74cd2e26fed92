"""Tests of ``microrl.kernels`` (kernels/): ``fused_linear_logprob`` against its eager reference
(shapes, dtypes and the fp32 head, head transforms, ``validate=False``, seed-bug regressions), the
fused loss path (``fused_linear_loss``, and the engine's ``fuse_loss`` against the unfused path),
the vocab-parallel kernels on 2 gloo ranks, and the GPU path on CPU tensors (its torch row ops,
its Triton kernels under Triton's interpreter and compiled for an H100, the dispatch rule).

Helpers: ``kernel_utils`` (tolerances per dtype, comparisons, forced vocabulary tiles and GPU
tiles) and ``vocab_parallel_utils`` (the vocab-parallel cases and their inputs), here;
``triton_interpreted.py`` and ``triton_compiled.py`` run in processes of their own
(test_triton_rows.py).
"""
