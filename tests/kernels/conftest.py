"""Tests of ``microrl.kernels`` (kernels/): ``fused_linear_logprob`` against its eager reference
(shapes, dtypes and the fp32 head, head transforms, ``validate=False``, seed-bug regressions), the
fused loss path (``fused_linear_loss``, and the engine's ``fuse_loss`` against the unfused path),
and the vocab-parallel kernels on 2 gloo ranks.

Helpers: ``kernel_utils`` (tolerances per dtype, comparisons, forced vocabulary tiles) and
``vocab_parallel_utils`` (the vocab-parallel cases and their inputs), here.
"""
