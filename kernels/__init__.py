"""microrl.kernels: compute kernels that depend on torch only.

``fused_linear_logprob`` turns hidden states and an lm-head weight into per-token log-probs and
entropy without materialising the ``[N, V]`` logits, with float32 logits whatever the input
dtypes; ``reference_linear_logprob`` is its eager, obviously-correct definition (tests and
benchmarks compare against it); ``fused_linear_loss`` runs a loss of those log-probs inside the
head and forms its gradients in forward; ``vocab_parallel_linear_logprob`` and
``vocab_parallel_linear_loss`` are the same two with the vocabulary split over tensor-parallel
ranks. ``IGNORE_INDEX`` (-100) is their default ``ignore_index``; ``HeadOptions`` types the head
keywords they share. Each call runs one of
``IMPLEMENTATIONS`` (CUDA tensors a GPU path, other devices CPU tiles): ``head_implementation``
says which one a call would take, ``last_implementation`` which one the last call took. Their
contract is in ``docs/kernels.md``.

The folder also sits at the repository root, where a Python started there finds it as the
top-level ``kernels``: that name belongs to Hugging Face's kernel hub package (a transformers
dependency), so under that name this module hands itself over to the installed one.
"""

import sys


def _hand_over_to_hub_kernels() -> bool:
    """Replace this top-level ``kernels`` by Hugging Face's installed one; False when none is."""
    import importlib.machinery
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    if spec is None or spec.loader is None:
        return False
    hub = importlib.util.module_from_spec(spec)
    # The import system returns whatever sys.modules holds once this body ends.
    sys.modules["kernels"] = hub
    spec.loader.exec_module(hub)
    return True


if __name__ != "kernels" or not _hand_over_to_hub_kernels():
    from ._checks import IGNORE_INDEX, HeadOptions
    from ._dispatch import IMPLEMENTATIONS, head_implementation, last_implementation
    from .chunked_loss import head_budget_bytes
    from .fused_loss import FusedLossOutput, fused_linear_loss
    from .linear_logprob import WORKING_TILE_ELEMENTS, fused_linear_logprob
    from .reference import reference_linear_logprob
    from .vocab_parallel import vocab_parallel_linear_logprob
    from .vocab_parallel_loss import vocab_parallel_linear_loss

__all__ = [
    "IGNORE_INDEX",
    "IMPLEMENTATIONS",
    "WORKING_TILE_ELEMENTS",
    "FusedLossOutput",
    "HeadOptions",
    "fused_linear_logprob",
    "fused_linear_loss",
    "head_budget_bytes",
    "head_implementation",
    "last_implementation",
    "reference_linear_logprob",
    "vocab_parallel_linear_logprob",
    "vocab_parallel_linear_loss",
]
