"""microrl.kernels: compute kernels that depend on torch only.

``fused_linear_logprob`` turns hidden states and an lm-head weight into per-token log-probs and
entropy without materialising the ``[N, V]`` logits, with float32 logits whatever the input
dtypes; ``reference_linear_logprob`` is its eager, obviously-correct definition (tests and
benchmarks compare against it). Their contract is in ``docs/kernels.md``.
"""

from .linear_logprob import WORKING_TILE_ELEMENTS, fused_linear_logprob
from .reference import reference_linear_logprob
from .vocab_parallel import vocab_parallel_linear_logprob

__all__ = [
    "WORKING_TILE_ELEMENTS",
    "fused_linear_logprob",
    "reference_linear_logprob",
    "vocab_parallel_linear_logprob",
]
