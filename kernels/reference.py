"""Eager reference for ``fused_linear_logprob``: the obviously-correct, memory-hungry definition.

It materialises the full ``[N, V]`` logits and lets autograd differentiate ``log_softmax``, so it
is the ground truth for tests and the baseline ("eager") in ``benchmarks/bench_kernel.py``. The
contract both implement is in ``docs/kernels.md``.
"""

from __future__ import annotations

import torch

from ._checks import check_linear_logprob_inputs, compute_dtype, no_autocast

__all__ = ["reference_linear_logprob"]


def reference_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    with_entropy: bool = True,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax((hidden.float() @ weight.float().T) / temperature)`` at ``targets``, and the
    entropy of that distribution (float64 instead of float32 when an input is float64).

    Same signature, validation and semantics as :func:`microrl.kernels.fused_linear_logprob`;
    ``chunk_size`` is validated and otherwise ignored (nothing is chunked here); ``validate=False``
    skips the value checks as there (targets and temperatures trusted to be in range).

    Args:
        hidden: ``[..., H]``, any float dtype.
        weight: ``[V, H]``, any float dtype (need not match ``hidden``'s: both are upcast).
        targets: ``[...]`` integer token ids; ``ignore_index`` positions give 0 and no gradient.

    Returns:
        ``(logprobs [...], entropy [...] | None)`` in float32 (float64 when an input is
        float64). Gradients come back in each input's own dtype (autograd of the upcast).
    """
    temp, _ = check_linear_logprob_inputs(
        hidden, weight, targets, temperature, with_entropy, chunk_size, ignore_index, validate
    )
    cdtype = compute_dtype(hidden.dtype, weight.dtype)
    with no_autocast(hidden.device.type):  # autocast would run the matmul in 16 bits
        logits = hidden.to(cdtype) @ weight.to(cdtype).T
        logits = logits / (temp.unsqueeze(-1) if isinstance(temp, torch.Tensor) else temp)
        log_probs = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0).long()
    picked = log_probs.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(valid, picked, 0.0)
    if not with_entropy:
        return logprobs, None
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, torch.where(valid, entropy, 0.0)
