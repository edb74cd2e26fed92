"""Router losses (losses/router.py): micro-batch partials that sum to the whole batch's loss.

The reference is transformers' own ``load_balancing_loss_func`` (the function Qwen3-MoE, OLMoE
and GPT-OSS call with ``output_router_logits=True``) applied to the whole batch at once; the
partials are computed over arbitrary splits of the tokens with the batch's load fractions and
row count given up front. A per-split loss (each split's own fractions) is shown to differ.
"""

from __future__ import annotations

import pytest
import torch

from microrl.losses.router import (
    RouterDenominators,
    expert_counts,
    load_balancing_partial,
    z_loss_partial,
)

E, K, LAYERS = 4, 2, 3


def _logits(tokens: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(tokens, E, generator=g, dtype=torch.float64).requires_grad_()
        for _ in range(LAYERS)
    ]


def _denominators(logits, valid) -> RouterDenominators:
    """The whole batch's counts: top-k of each layer's softmax over the valid rows."""
    counts = sum(
        expert_counts(torch.softmax(x.detach(), -1).topk(K).indices, valid, E) for x in logits
    )
    rows = valid.sum().double() * LAYERS
    return RouterDenominators(rows, counts / rows)


def _splits(tokens: int) -> list[list[torch.Tensor]]:
    """Token index sets: one split, single tokens, and an uneven 3-way split."""
    order = torch.randperm(tokens, generator=torch.Generator().manual_seed(1))
    return [[torch.arange(tokens)], [torch.tensor([t]) for t in range(tokens)], order.split(5)]


@pytest.mark.parametrize("split", [0, 1, 2], ids=["whole", "per-token", "uneven"])
def test_load_balancing_partials_sum_to_the_models_own_loss(split):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    tokens = 12
    logits = _logits(tokens)
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[[3, 7]] = False  # padding rows: masked in both
    expected = load_balancing_loss_func(tuple(logits), E, K, attention_mask=valid[None].long())
    expected_grads = torch.autograd.grad(expected, logits)
    den = _denominators(logits, valid)
    total = sum(
        load_balancing_partial([x[idx] for x in logits], valid[idx], den)
        for idx in _splits(tokens)[split]
    )
    grads = torch.autograd.grad(total, logits)
    torch.testing.assert_close(total, expected.double(), rtol=1e-6, atol=0)  # HF sums in fp32
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=1e-9)


def test_a_per_micro_batch_load_balancing_loss_is_not_the_batch_loss():
    """The check above can fail: each split's own fractions give another value and gradient."""
    tokens = 12
    logits = _logits(tokens)
    valid = torch.ones(tokens, dtype=torch.bool)
    whole = load_balancing_partial(logits, valid, _denominators(logits, valid))
    per_split = 0
    for idx in _splits(tokens)[2]:
        part = [x[idx] for x in logits]
        own = _denominators(part, valid[idx])
        per_split = per_split + load_balancing_partial(part, valid[idx], own) * len(idx) / tokens
    assert abs(float(per_split.detach()) - float(whole.detach())) > 1e-3


def test_z_loss_partials_sum_to_the_mean_over_layers_and_tokens():
    tokens = 9
    logits = _logits(tokens, seed=2)
    valid = torch.ones(tokens, dtype=torch.bool)
    valid[0] = False
    expected = sum((torch.logsumexp(x[valid], -1) ** 2).sum() for x in logits) / (8 * LAYERS)
    den = RouterDenominators(torch.tensor(8.0 * LAYERS, dtype=torch.float64))
    total = sum(z_loss_partial([x[i] for x in logits], valid[i], den) for i in _splits(tokens)[2])
    torch.testing.assert_close(total, expected, rtol=1e-12, atol=0)


def test_expert_counts_skip_invalid_rows_and_their_ids():
    experts = torch.tensor([[0, 3], [-1, -1], [3, 1]], dtype=torch.int16)
    valid = torch.tensor([True, False, True])
    assert expert_counts(experts, valid, E).tolist() == [1.0, 1.0, 0.0, 2.0]


def test_load_balancing_needs_the_load_fractions():
    with pytest.raises(ValueError, match="load fractions"):
        load_balancing_partial(_logits(2), torch.ones(2, dtype=torch.bool), RouterDenominators(1))
