"""The on-policy distillation advantage against a float64 hand computation (losses/distill.py)."""

from __future__ import annotations

import pytest
import torch

from microrl.losses import distillation_advantages


def _reference(teacher, student, mask, gamma: float) -> torch.Tensor:
    """Row by row, loss token by loss token, in float64: sum_j gamma^j r[t_{k+j}]."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if mask[b, t]]
        rewards = [float(teacher[b, t]) - float(student[b, t]) for t in cols]
        for k, t in enumerate(cols):
            out[b, t] = sum(gamma**j * r for j, r in enumerate(rewards[k:]))
    return out


def _inputs(rows: int = 5, width: int = 9, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=gen) < 0.6  # gaps: multi-turn-like holes
    mask[-1] = False  # a row without a loss token
    teacher = -torch.rand(rows, width, generator=gen) * 4
    student = -torch.rand(rows, width, generator=gen) * 4
    # Off the mask anything may stand, NaN included: it must not leak.
    return teacher.masked_fill(~mask, torch.nan), student.masked_fill(~mask, -torch.inf), mask


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_distillation_advantages_match_a_float64_hand_computation(gamma: float) -> None:
    teacher, student, mask = _inputs()
    got = distillation_advantages(teacher, student, mask, gamma=gamma)
    expected = _reference(teacher, student, mask, gamma)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)  # float32 output
    assert (got[~mask] == 0).all()


def test_gamma_zero_is_the_per_token_log_ratio() -> None:
    teacher, student, mask = _inputs(seed=3)
    got = distillation_advantages(teacher, student, mask)
    torch.testing.assert_close(got[mask], (teacher - student)[mask], rtol=0, atol=1e-6)


def test_distillation_advantages_are_the_same_for_any_split_of_the_rows() -> None:
    """Each row's advantages depend on its own tokens only: micro-batches or ranks of any size
    compute the same numbers (the engine-side check is tests/run/test_teacher.py)."""
    teacher, student, mask = _inputs(rows=7, seed=5)
    whole = distillation_advantages(teacher, student, mask, gamma=0.9)
    for parts in (1, 2, 7):
        split = [
            distillation_advantages(t, s, m, gamma=0.9)
            for t, s, m in zip(
                teacher.tensor_split(parts),
                student.tensor_split(parts),
                mask.tensor_split(parts),
                strict=True,
            )
        ]
        torch.testing.assert_close(torch.cat(split), whole, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gamma": -0.1}, "gamma must be a float in"),
        ({"gamma": 1.5}, "gamma must be a float in"),
        ({"student_logprobs": torch.zeros(2, 3)}, r"student_logprobs must have loss_mask's shape"),
        ({"teacher_logprobs": torch.zeros(3, 4)}, r"teacher_logprobs must have loss_mask's shape"),
    ],
)
def test_distillation_advantages_refuse_bad_input(kwargs, match: str) -> None:
    args = {
        "teacher_logprobs": torch.zeros(2, 4),
        "student_logprobs": torch.zeros(2, 4),
        "loss_mask": torch.ones(2, 4, dtype=torch.bool),
    }
    gamma = kwargs.pop("gamma", 0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        distillation_advantages(**args, gamma=gamma)
