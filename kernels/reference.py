"""Eager reference for ``fused_linear_logprob``: the obviously-correct, memory-hungry definition.

It materialises the full ``[N, V]`` logits and lets autograd differentiate ``log_softmax``: the
obviously-correct definition, the baseline ("eager") in ``benchmarks/bench_kernel.py``, and in
float64 the ground truth of the tests. In float32 it is accurate to one long float32 sum over the
vocabulary, which at large ``V`` with a peaked row loses the small terms (docs/kernels.md, "What
is exact and what is within tolerance"). The contract both implement is in ``docs/kernels.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import check_linear_logprob_inputs, head_dtype, head_spec, no_autocast

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._checks import HeadOptions


__all__ = ["reference_linear_logprob"]


def reference_linear_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    **head: Unpack[HeadOptions],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(cap((hidden.float() @ weight.float().T + bias) * logit_scale) / temperature)``
    at ``targets``, with ``cap(x) = softcap * tanh(x / softcap)`` (the identity for
    ``softcap=None``), and the entropy of that distribution (float64 instead of float32 when an
    input is float64). The transforms run in the order the transformers models apply them (Phi's
    bias in the head, Cohere's ``logits * logit_scale`` / Granite's ``logits / logits_scaling``,
    Gemma 2/3's ``tanh(logits / cap) * cap``), then the temperature.

    Same signature, validation and semantics as :func:`microrl.kernels.fused_linear_logprob`;
    ``chunk_size`` and ``implementation`` are validated and otherwise ignored (nothing is
    chunked here; there is one implementation); ``validate=False``
    skips the value checks as there (targets and temperatures trusted to be in range).

    Args:
        hidden: ``[..., H]``, any float dtype.
        weight: ``[V, H]``, any float dtype (need not match ``hidden``'s: both are upcast).
        targets: ``[...]`` integer token ids; ``ignore_index`` positions give 0 and no gradient.
        bias, logit_scale, softcap: the logit transform, as in ``fused_linear_logprob``.

    Returns:
        ``(logprobs [...], entropy [...] | None)`` in float32 (float64 when an input is
        float64). Gradients come back in each input's own dtype (autograd of the upcast).
    """
    spec, temperature, bias = head_spec("reference_linear_logprob", head)
    spec, per_token, _ = check_linear_logprob_inputs(
        hidden, weight, targets, temperature, bias, spec
    )
    cdtype = head_dtype(hidden, weight, bias)
    with no_autocast(hidden.device.type):  # autocast would run the matmul in 16 bits
        logits = hidden.to(cdtype) @ weight.to(cdtype).T
        if bias is not None:
            logits = logits + bias.to(cdtype)
        if spec.logit_scale != 1.0:
            logits = logits * spec.logit_scale
        if spec.softcap is not None:
            logits = torch.tanh(logits / spec.softcap) * spec.softcap
        logits = logits / (spec.temperature if per_token is None else per_token.unsqueeze(-1))
        log_probs = torch.log_softmax(logits, dim=-1)
    targets = targets.long()  # compared as int64: in uint8, -100 would equal 156
    valid = targets != spec.ignore_index
    safe_targets = torch.where(valid, targets, 0)
    picked = log_probs.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(valid, picked, 0.0)
    if not spec.with_entropy:
        return logprobs, None
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, torch.where(valid, entropy, 0.0)
