"""DAPO's soft overlong penalty (microrl/tasks/overlong.py) against its formula (DAPO eq. 13)."""

from __future__ import annotations

import pytest
import torch

from microrl.rollout import Samples, build_rollout
from microrl.tasks import overlong_penalty


def formula(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's R_length, scaled by the penalty, in plain Python floats (float64)."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_new_tokens:
        return (start - length) / buffer * penalty
    return -penalty


@pytest.mark.parametrize(
    ("max_new_tokens", "buffer", "penalty"),
    [(4, 2, 1.0), (16, 5, 0.5), (8, 7, 2.0), (8, 1, 1.0), (10, 3, 0.0), (256, 64, 1.0)],
)
def test_the_penalty_is_the_formula_at_every_length(max_new_tokens, buffer, penalty) -> None:
    lengths = torch.arange(0, max_new_tokens + 3)
    got = overlong_penalty(lengths, max_new_tokens, buffer, penalty, dtype=torch.float64)
    want = [formula(n, max_new_tokens, buffer, penalty) for n in lengths.tolist()]
    assert got.dtype == torch.float64 and got.tolist() == want  # the same float64 arithmetic
    start = max_new_tokens - buffer
    assert got[start] == 0.0  # the last free length
    assert got[start + 1] == pytest.approx(-penalty / buffer)  # the first penalised one
    assert got[max_new_tokens] == -penalty  # a response using the whole budget
    assert (got[1:] <= got[:-1]).all()  # never rises with the length
    as_float32 = overlong_penalty(lengths, max_new_tokens, buffer, penalty)
    assert as_float32.dtype == torch.float32 and torch.equal(as_float32, got.float())


def test_off_and_lengths_of_any_integer_or_float_dtype() -> None:
    lengths = torch.tensor([0, 1, 3, 4], dtype=torch.int32)
    assert torch.equal(overlong_penalty(lengths, 4, 0), torch.zeros(4))
    assert overlong_penalty(lengths.float(), 4, 2).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(torch.zeros(0, dtype=torch.long), 4, 2).shape == (0,)


def test_response_lengths_count_the_eos() -> None:
    """The recipes' |y|: the loss tokens of a rollout row, its <eos> included; a response cut at
    max_new_tokens and one ending with <eos> as its last allowed token both get -penalty."""
    eos, pad = 1, 0
    samples = Samples(
        token_ids=[[5, eos, 7, 7], [5, 6, eos, 7], [5, 6, 7, eos], [5, 6, 7, 8]],
        logprobs=[[-0.1] * 4] * 4,
    )
    batch = build_rollout([[3, 4]], samples, num_samples=4, eos_token_id=eos, pad_token_id=pad)
    lengths = batch["loss_mask"].sum(1)
    assert lengths.tolist() == [2, 3, 4, 4]
    assert batch["truncated"].tolist() == [False, False, False, True]
    assert overlong_penalty(lengths, 4, 2).tolist() == [0.0, -0.5, -1.0, -1.0]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(2, 2), 4, 1, 1.0), "lengths must be a"),
        ((torch.zeros(2), 0, 0, 1.0), "max_new_tokens"),
        ((torch.zeros(2), 4, 4, 1.0), "overlong_buffer"),
        ((torch.zeros(2), 4, -1, 1.0), "overlong_buffer"),
        ((torch.zeros(2), 4, 1, -0.5), "overlong_penalty"),
        ((torch.zeros(2), 4, 1, float("inf")), "overlong_penalty"),
    ],
)
def test_bad_arguments_name_the_key(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        overlong_penalty(*args)
