"""The addition task (microrl/tasks/addition.py): its exact-match reward, answer parsing, and the
eval prompts held out of training."""

from __future__ import annotations

import random

import pytest

from microrl.tasks import AdditionTask, exact_match_reward, parse_answer


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("19", "19", 1.0),
        (" 19 ", "19", 1.0),  # surrounding whitespace is not part of the answer
        ("0", "0", 1.0),
        ("18", "19", 0.0),
        ("019", "19", 0.0),  # no leading zeros
        ("19+0", "19", 0.0),
        ("1 9", "19", 0.0),
        ("", "19", 0.0),
        ("=19", "19", 0.0),
        ("١٩", "19", 0.0),  # non-ASCII digits are not an answer
        ("191", "19", 0.0),
    ],
)
def test_exact_match_reward_reads_only_the_answer_text(response, answer, reward) -> None:
    assert exact_match_reward(response, answer) == reward


def test_parse_answer() -> None:
    assert parse_answer(" 42\n") == "42"
    assert parse_answer("4 2") is None
    assert parse_answer("-4") is None


def test_task_keeps_eval_prompts_out_of_training() -> None:
    task = AdditionTask(max_operand=9, eval_size=10, seed=3)
    held_out = {p.prompt for p in task.eval_problems()}
    assert len(held_out) == 10
    train = task.sample(random.Random(0), 2000)
    assert not held_out & {p.prompt for p in train}
    assert all(str(eval(p.prompt[:-1])) == p.answer for p in train[:50])
    assert task.score(["7", "x"], [AdditionTask.make(3, 4), AdditionTask.make(3, 4)]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="eval_size"):
        AdditionTask(max_operand=3, eval_size=16)
    with pytest.raises(ValueError, match="responses"):
        task.score(["1"], [])
