"""The toy base models' warm start (microrl/run/warm_start.py, used by microrl/run/base_model.py
and microrl/run/toy_vision.py): it stops at the first check whose
greedy accuracy reaches ``model.warm_start.target_accuracy``, checking every ``eval_every`` steps,
and at ``max_steps`` when the target is never reached (saying so). The accuracies are scripted:
what is tested is the rule, not how fast the toy model learns."""

from __future__ import annotations

from pathlib import Path

import pytest

from microrl.configs.run import ModelConfig, TaskConfig, WarmStartConfig
from microrl.run import Dist, prepare_base_model
from microrl.run import base_model as base_model_module
from microrl.run import warm_start as warm_start_module
from microrl.run.toy_model import is_checkpoint

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2}


@pytest.mark.parametrize(
    ("accuracies", "checks", "stop"),
    [
        ([0.1, 0.2, 0.31, 0.9], 3, "step    9"),  # the first check at or above 0.3: step 3 * 3
        ([0.1, 0.2, 0.25, 0.29], 4, "max_steps=12 below"),  # never reached: the cap, and a note
    ],
)
def test_the_warm_start_stops_at_the_first_check_reaching_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accuracies, checks, stop
) -> None:
    steps: list[int] = []
    scripted = iter(accuracies)

    def evaluate_accuracy(*args, **kwargs) -> float:
        steps.append(len(steps))
        return next(scripted)

    monkeypatch.setattr(warm_start_module, "evaluate_accuracy", evaluate_accuracy)
    warm_start = WarmStartConfig(max_steps=12, eval_every=3, batch_size=8, target_accuracy=0.3)
    cfg = ModelConfig(path=str(tmp_path / "base"), build_toy=True, warm_start=warm_start, **TINY)
    lines: list[str] = []
    prepare_base_model(cfg, TaskConfig(max_operand=9, eval_size=8), Dist(), 4, log=lines.append)
    assert len(steps) == checks
    assert any(stop in line for line in lines), lines
    assert is_checkpoint(tmp_path / "base")


def test_the_warm_start_batch_is_prompt_answer_eos_with_the_loss_on_the_answer() -> None:
    from microrl.run.toy_model import build_tokenizer

    tok = build_tokenizer()
    sft = base_model_module.sft_batch(tok, ["1+2=", "34+56="], ["3", "90"])
    prompt, answer = tok("1+2=")["input_ids"], tok("3", add_special_tokens=False)["input_ids"]
    row = prompt + answer + [tok.eos_token_id]
    assert sft["input_ids"][0, : len(row)].tolist() == row
    assert sft["loss_mask"][0].tolist()[: len(row)] == [False] * len(prompt) + [True] * (
        len(answer) + 1
    )
    assert not sft["loss_mask"][0, len(row) :].any()  # right padding is no loss
    with pytest.raises(ValueError, match="as many answers as prompts"):
        base_model_module.sft_batch(tok, ["1+2="], [])
