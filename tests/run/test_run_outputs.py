"""What a run shows and leaves beside its metrics (docs/tracking.md, "What output.dir holds").

- ``output.log_samples_every``: a few sampled completions (step, group, reward, prompt,
  response) in ``samples.jsonl`` and as a TensorBoard text table, one response per prompt
  first (a multi-turn row's prompt as the model saw it); rank 0 only; ``--resume`` continues the file after the checkpoint's step;
- ``output.export_merged``: ``merged/``, a plain transformers checkpoint with its tokenizer,
  whose log-probs are the trained policy's (the base model with the adapter loaded by peft);
- the end-of-run line lists both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from example_utils import TINY_MODEL, TINY_RL, load_example
from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensordict import TensorDict

from microrl.rollout import Rollout, RolloutBackend, Samples, SamplingParams
from microrl.run import Tracker, read_metrics, sample_rows
from microrl.run.toy_model import build_tokenizer
from microrl.run.tracking import SAMPLES_FILE
from microrl.tasks import Problem

SAMPLE_KEYS = ["step", "group", "reward", "prompt", "response"]
# A reward that differs between a prompt's responses, so that GRPO's advantages (and the LoRA
# update) are not zero even for a model that never answers right.
LENGTH_REWARD = "def score(completions, **kwargs):\n    return [len(c) / 4 for c in completions]\n"


def _text_events(out: Path) -> dict[int, str]:
    """The TensorBoard text table of each step (tag ``samples``), as TensorBoard serves them
    (the events a resumed writer purges left out)."""
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    if "samples/text_summary" not in events.Tags()["tensors"]:
        return {}
    return {
        e.step: e.tensor_proto.string_val[0].decode()
        for e in events.Tensors("samples/text_summary")
    }


# ----------------------------------------------------------------------------- the library
def test_sample_rows_show_one_response_per_prompt_first() -> None:
    problems = [Problem("1+1=", "2"), Problem("2+2=", "4"), Problem("3+3=", "6")]
    rollout = Rollout(
        batch=TensorDict({}, batch_size=[6]),
        texts=["2", "3", "4", "5", "6", "7"],
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
    )
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.5])
    rows = list(sample_rows(rollout, problems, scores))
    assert [(r["group"], r["response"]) for r in rows] == [
        (0, "2"),
        (1, "4"),
        (2, "6"),
        (0, "3"),
        (1, "5"),
        (2, "7"),
    ]
    assert rows[5] == {"group": 2, "reward": 0.5, "prompt": "3+3=", "response": "7"}
    assert type(rows[0]["reward"]) is float


class _Sevens(RolloutBackend):
    """Every turn is ``7<eos>``."""

    def _sample(self, prompt_ids, params) -> Samples:
        ids = [self.tokenizer.convert_tokens_to_ids("7"), self.tokenizer.eos_token_id]
        return Samples(token_ids=[ids] * len(prompt_ids), logprobs=[[-0.5, -0.5]] * len(prompt_ids))


class _WrappingEnv:
    """Puts a system message before the dataset prompt; a ``+`` hint, then done."""

    def __init__(self) -> None:
        self.turns = 0

    def init(self, prompt):
        return [{"role": "system", "content": "9 "}, {"role": "user", "content": prompt}], {}

    def step(self, action):
        self.turns += 1
        done = self.turns == 2
        hint = [] if done else [{"role": "user", "content": "+"}]
        return {"observations": hint, "reward": 1.0, "done": done}


def test_a_multi_turn_rows_prompt_is_what_the_model_saw() -> None:
    # Not the dataset prompt: the environment's first input, rendered (the toy tokenizer's plain
    # template: <bos>, then the messages' contents), beside the trajectory with its hint.
    tokenizer = build_tokenizer()
    problems = [Problem("1+1=", "2"), Problem("22+3=", "25")]
    rollout = _Sevens(tokenizer).run_episodes(
        [p.prompt for p in problems],
        lambda i: _WrappingEnv(),
        SamplingParams(num_samples=2, max_new_tokens=4),
        max_turns=3,
        max_tokens=16,
    )
    rows = list(sample_rows(rollout, problems, rollout.rewards, tokenizer))
    assert [(r["group"], r["prompt"]) for r in rows] == [
        (0, "<bos>9 1+1="),
        (1, "<bos>9 22+3="),
        (0, "<bos>9 1+1="),
        (1, "<bos>9 22+3="),
    ]
    assert rows[0]["response"] == "7<eos>+7<eos>" and rows[0]["reward"] == 2.0
    with pytest.raises(ValueError, match="needs the tokenizer"):
        sample_rows(rollout, problems, rollout.rewards)


def _log_steps(out: Path, start: int, end: int, *, every: int, per_step: int = 2) -> None:
    tracker = Tracker(
        out,
        total_steps=end,
        start_step=start,
        progress=False,
        log_every=0,
        samples_every=every,
        samples_per_step=per_step,
    )
    for step in range(start + 1, end + 1):
        tracker.log(step, {"reward": 0.5})
        rows = (
            {"group": g, "reward": 0.5, "prompt": "1+1=", "response": "a|*<b>"} for g in range(3)
        )
        tracker.log_samples(step, rows)
    tracker.close(plot=False)


def test_tracker_logs_samples_every_n_steps_and_resume_continues_the_file(tmp_path: Path) -> None:
    _log_steps(tmp_path, 0, 5, every=2)  # steps 2 and 4, and the last
    rows = read_metrics(tmp_path / SAMPLES_FILE)
    assert [(r["step"], r["group"]) for r in rows] == [
        (2, 0),
        (2, 1),
        (4, 0),
        (4, 1),
        (5, 0),
        (5, 1),
    ]
    assert all(list(r) == SAMPLE_KEYS for r in rows)
    text = _text_events(tmp_path)
    assert sorted(text) == [2, 4, 5]
    assert text[2].splitlines() == [
        "| group | reward | prompt | response |",
        "| --- | --- | --- | --- |",
        "| 0 | 0.5 | 1\\+1= | a\\|\\*&lt;b&gt; |",  # shown as written, not as Markdown / HTML
        "| 1 | 0.5 | 1\\+1= | a\\|\\*&lt;b&gt; |",
    ]
    # --resume from a checkpoint of step 4 (step 5 was logged, not saved) up to step 6: the
    # file keeps the steps up to 4 and continues; TensorBoard drops its later events likewise.
    _log_steps(tmp_path, 4, 6, every=2)
    rows = read_metrics(tmp_path / SAMPLES_FILE)
    assert [r["step"] for r in rows] == [2, 2, 4, 4, 6, 6]
    assert sorted(_text_events(tmp_path)) == [2, 4, 6]
    # A fresh start empties it; 0 logs nothing.
    _log_steps(tmp_path, 0, 2, every=0)
    assert read_metrics(tmp_path / SAMPLES_FILE) == []


def test_only_the_main_rank_logs_samples(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, total_steps=1, enabled=False, samples_every=1)
    tracker.log_samples(1, iter([{"group": 0}]))
    assert not tmp_path.joinpath(SAMPLES_FILE).exists()


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the first run builds its tiny base model, shared by the others."""
    return tmp_path_factory.mktemp("base") / "tiny-adder"


def _args(tmp_path: Path, base_model: Path, out: Path) -> list[str]:
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    return [
        *TINY_MODEL,
        *TINY_RL,
        f"model.path={base_model}",
        f"output.dir={out}",
        f"task.rewards.functions=[{reward}:score]",
        "actor.optim.lr=1e-2",
        "output.plot=false",
        "output.log_samples_every=1",
        "output.log_samples=3",
        "output.export_merged=true",
    ]


def _check_samples(out: Path, steps: list[int]) -> list[dict]:
    rows = read_metrics(out / SAMPLES_FILE)
    assert [r["step"] for r in rows] == [s for s in steps for _ in range(3)]
    assert all(list(r) == SAMPLE_KEYS for r in rows)
    assert [r["group"] for r in rows[:3]] == [0, 1, 2]  # one response per prompt
    assert all(r["prompt"].endswith("=") and isinstance(r["response"], str) for r in rows)
    assert all(r["reward"] == len(r["response"]) / 4 for r in rows)
    assert sorted(_text_events(out)) == steps
    return rows


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.float(), dim=-1)


def _check_merged(base_model: Path, out: Path) -> None:
    """``merged/`` loads with transformers alone and scores like base + adapter (peft)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged_dir = out / "merged"
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_config(merged.config)
    assert merged.state_dict().keys() == plain.state_dict().keys()  # no lora_ / base_layer keys
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    base_tokenizer = AutoTokenizer.from_pretrained(base_model)
    assert tokenizer("3+4=").input_ids == base_tokenizer("3+4=").input_ids

    prompt = tokenizer("3+4=", return_tensors="pt").input_ids
    ids = merged.generate(
        prompt, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, out / "adapter").eval()
    expected = _logprobs(with_adapter, ids)
    torch.testing.assert_close(_logprobs(merged, ids), expected, rtol=1e-5, atol=1e-5)
    with with_adapter.disable_adapter():  # the LoRA did change the policy: not a vacuous check
        assert (_logprobs(with_adapter, ids) - expected).abs().max() > 1e-3


def test_grpo_logs_samples_resumes_them_and_exports_a_merged_model(
    base_model: Path, tmp_path: Path, capsys
) -> None:
    grpo_lora = load_example("grpo_lora")
    out = tmp_path / "grpo"
    args = _args(tmp_path, base_model, out)
    assert grpo_lora.main([*args, "train.steps=2"]) == 0
    first = _check_samples(out, [1, 2])
    text = capsys.readouterr().out
    assert "samples.jsonl" in text and "merged/" in text.split("outputs in")[1]
    _check_merged(base_model, out)

    assert grpo_lora.main(["--resume", f"output.dir={out}", "train.steps=3"]) == 0
    assert _check_samples(out, [1, 2, 3])[:6] == first  # appended after the checkpoint's step
    _check_merged(base_model, out)  # replaced by the longer run's


def test_ppo_exports_the_actors_merged_policy(base_model: Path, tmp_path: Path, capsys) -> None:
    ppo_lora = load_example("ppo_lora")
    out = tmp_path / "ppo"
    assert ppo_lora.main([*_args(tmp_path, base_model, out), "train.steps=2"]) == 0
    _check_samples(out, [1, 2])
    assert "merged/" in capsys.readouterr().out.split("outputs in")[1]
    assert json.loads((out / "merged" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]
    _check_merged(base_model, out)
