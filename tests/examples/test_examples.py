"""The example trainings end to end (tiny sizes), and their task, tokenizer and rollout pieces."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.configs.examples import ModelConfig
from microrl.engine.rollout import HFRollout, SamplingParams, sft_batch
from microrl.run import read_metrics
from microrl.tasks import AdditionTask, exact_match_reward, parse_answer
from microrl.tasks.toy_model import build_model, build_tokenizer, is_checkpoint, load_pretrained

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


# ----------------------------------------------------------------------------- task and reward
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


# ----------------------------------------------------------------------------- tokenizer, model
def test_tokenizer_is_a_real_fast_tokenizer_that_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = build_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    ids = tok("12+7=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert (
        tok.decode(
            tok("19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
            skip_special_tokens=True,
        )
        == "19"
    )
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded("12+7=")["input_ids"] == ids
    assert loaded.padding_side == "left" and loaded.pad_token_id == tok.pad_token_id


def test_rollout_layout_is_token_aligned() -> None:
    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    torch.manual_seed(0)
    params = SamplingParams(num_samples=3, max_new_tokens=4)
    rollout = HFRollout(model, tok).generate(["1+2=", "34+56="], params)
    batch = rollout.batch
    assert batch.batch_size == torch.Size([6]) and rollout.group_ids.tolist() == [
        0,
        0,
        0,
        1,
        1,
        1,
    ]
    prompt_width = tok(["1+2=", "34+56="], padding=True, return_tensors="pt")["input_ids"].shape[1]
    assert prompt_width < batch["input_ids"].shape[1] <= prompt_width + 4
    mask, attention, ids = batch["loss_mask"], batch["attention_mask"], batch["input_ids"]
    assert not mask[:, :prompt_width].any()
    assert (mask <= attention).all()
    for row in range(6):
        response = ids[row, prompt_width:][mask[row, prompt_width:]]
        eos = (response == tok.eos_token_id).nonzero()
        # the loss covers the response up to and including its first <eos>, nothing after
        assert eos.numel() <= 1 and (eos.numel() == 0 or eos.item() == len(response) - 1)
        assert rollout.texts[row] == tok.decode(response, skip_special_tokens=True)
    sft = sft_batch(tok, ["1+2="], ["3"])
    assert sft["input_ids"][0].tolist() == tok("1+2=")["input_ids"] + tok(
        "3", add_special_tokens=False
    )["input_ids"] + [tok.eos_token_id]
    assert sft["loss_mask"][0].tolist() == [False] * 5 + [True, True]


def test_sampling_distribution_is_the_one_the_engine_scores() -> None:
    """Log-probs of the sampled tokens under ``generate`` equal the engine's: ratio 1 at step 1."""
    from microrl.configs import ActorConfig, LoraConfig
    from microrl.engine import ActorEngine

    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    engine = ActorEngine(model, ActorConfig(temperature=0.7, lora=LoraConfig(rank=2)))
    torch.manual_seed(0)
    params = SamplingParams(num_samples=2, temperature=0.7, max_new_tokens=4)
    rollout = HFRollout(engine, tok).generate(["1+2=", "34+56="], params)
    batch = rollout.batch
    logprobs = engine.infer_batch(batch)["logprobs"]
    # Reference: the model's own logits at the sampling temperature, token-aligned.
    with torch.no_grad():
        am = batch["attention_mask"].long()
        logits = engine.model(
            input_ids=batch["input_ids"],
            attention_mask=am,
            position_ids=(am.cumsum(-1) - 1).clamp(min=0),
        ).logits
    ref = (logits[:, :-1] / 0.7).log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:]
    torch.testing.assert_close(logprobs[:, 1:][mask], ref[mask], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny warm-started base model, built once by the GRPO example's own warm-start path."""
    return tmp_path_factory.mktemp("base") / "qwen2-adder"


def _run_in_process(module: str, args: list[str]) -> int:
    return load_example(module).main(args)


def _check_outputs(out: Path, last_step: int) -> list[dict]:

    records = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in records]
    assert steps == list(range(last_step + 1)), steps
    for key in (
        "reward",
        "loss",
        "kl",
        "entropy",
        "clipfrac",
        "grad_norm",
        "tokens_per_s",
        "step_time",
    ):
        assert all(key in r for r in records[1:]), key
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((out / "tensorboard").iterdir())
    return records


def _load_adapter(base: Path, adapter: Path) -> None:
    from peft import PeftModel

    _, model = load_pretrained(base)
    peft_model = PeftModel.from_pretrained(model, adapter)
    assert any("lora_A" in n for n, _ in peft_model.named_parameters())


def test_grpo_runs_writes_outputs_and_resumes(base_model: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "grpo"
    common = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}"]
    assert _run_in_process("grpo_lora", [*common, "train.steps=2"]) == 0
    assert is_checkpoint(base_model)  # the warm start saved model + tokenizer
    _check_outputs(out, last_step=2)
    _load_adapter(base_model, out / "adapter")
    assert "held-out greedy accuracy" in capsys.readouterr().out
    # --resume continues after the saved step, up to the new train.steps.
    assert _run_in_process("grpo_lora", [*common, "train.steps=3", "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out
    records = _check_outputs(out, last_step=3)
    assert records[-1]["step"] == 3


def test_ppo_runs_and_writes_outputs(base_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    args = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}", "train.steps=2"]
    assert _run_in_process("ppo_lora", args) == 0
    records = _check_outputs(out, last_step=2)
    assert all("critic/vf_loss" in r for r in records[1:])
    _load_adapter(base_model, out / "adapter")
    assert (out / "checkpoint" / "critic").is_dir()


def test_ctrl_c_saves_a_checkpoint_that_resume_continues(
    base_model: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "interrupted"
    args = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}"]
    cmd = [sys.executable, str(EXAMPLES / "grpo_lora.py"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*cmd, "train.steps=10000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(read_metrics(out / "metrics.jsonl")) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "continue with --resume" in output
    state = torch.load(out / "checkpoint" / "loop_state_rank0.pt", weights_only=True)
    saved = state["step"]
    assert saved >= 1 and read_metrics(out / "metrics.jsonl")[-1]["step"] == saved
    # The resumed run in-process (one interpreter start less): it continues after `saved`.
    assert _run_in_process("grpo_lora", [*args, f"train.steps={saved + 1}", "--resume"]) == 0
    assert f"at step {saved}" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(saved + 2))


@pytest.mark.distributed
def test_grpo_runs_under_torchrun_on_two_ranks(base_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "dp"
    args = [*TINY_MODEL, *TINY_RL, f"model.path={base_model}", f"output.dir={out}", "train.steps=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(EXAMPLES / "grpo_lora.py"), *args], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check_outputs(out, last_step=2)  # only rank 0 wrote them: one line per step
    assert result.stdout.count("held-out greedy accuracy:") == 1
    for rank in (0, 1):  # each rank saved its own loop state (prompt stream, RNG)
        assert (out / "checkpoint" / f"loop_state_rank{rank}.pt").is_file()
    _load_adapter(base_model, out / "adapter")


def test_help_lists_the_options(capsys) -> None:
    from microrl.configs.examples import GRPOExampleConfig
    from microrl.run import parse_cli

    with pytest.raises(SystemExit) as info:
        parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "GRPO", ["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--config",
        "--resume",
        "key.sub=value",
        "actor.optim.lr=",
        "rollout.group_size=",
    ):
        assert option in text
    with pytest.raises(SystemExit) as info:
        parse_cli(GRPOExampleConfig, "grpo_lora.yaml", "GRPO", ["train.stepz=3"])
    assert info.value.code == 2
    assert "train.stepz" in capsys.readouterr().err
