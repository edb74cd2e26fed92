"""Shared batch and helpers of the loss tests (test_losses.py, test_losses_errors.py,
test_kl_is_correction.py)."""

from __future__ import annotations

import torch

from microrl.losses import LossDenominators, global_denominators

SEQ_LEN_NORM = 16.0


def make_batch(
    dtype: torch.dtype,
    seed: int = 0,
    batch: int = 5,
    length: int = 11,
    spans: list[tuple[int, int]] | None = None,
) -> dict:
    """Rows of very different lengths (one of length 1, one all-masked), mixed padding sides,
    NaN/inf at every masked position. ``spans``: each row's ``[start, stop)`` of loss tokens
    (cycled over the rows); the default mixes both padding sides."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    spans = spans or [(2, length), (0, 1), (5, 9), (0, 0), (1, length - 1)]
    for b in range(batch):
        start, stop = spans[b % len(spans)]
        mask[b, start:stop] = True

    def rand(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(batch, length, generator=g, dtype=torch.float64) * scale

    logprobs = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    old = logprobs + rand(0.3)  # ratios spread over [0.4, 2.5]: every clip binds somewhere
    data = {
        "logprobs": logprobs,
        "old_logprobs": old,
        "advantages": rand(),
        "ref_logprobs": logprobs + rand(0.4),
        "entropy": torch.rand(batch, length, generator=g, dtype=torch.float64) * 2,
        "rollout_logprobs": old + rand(0.3),
    }
    poison = [float("nan"), float("inf"), float("-inf")]
    out = {}
    for i, (name, t) in enumerate(data.items()):
        t = t.masked_fill(~mask, poison[i % 3]).to(dtype)
        out[name] = t
    out["loss_mask"] = mask
    return out


def num(x) -> float:
    """A Python float from a (possibly grad-requiring) 0-d tensor or a number."""
    return x.detach().item() if isinstance(x, torch.Tensor) else float(x)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def denominators_for(mask: torch.Tensor) -> LossDenominators:
    return global_denominators(mask, seq_len_norm=SEQ_LEN_NORM)
