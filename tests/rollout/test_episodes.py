"""Multi-turn episodes (microrl/rollout/episodes.py, ``RolloutBackend.run_episodes``).

A scripted backend (its ``_sample`` replays fixed token ids and log-probs) pins the layout, the
stop rules and token in / token out exactly; the ``hf`` backend on the toy model checks that the
engine scores an episode batch at the log-probs the sampler drew (observations included as
context). skyrl-gym's own ``GSM8kMultiTurnEnv`` runs unchanged.
"""

from __future__ import annotations

import pytest
import torch
from episode_utils import ScriptedBackend, ScriptEnv
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from microrl.configs.run import ModelConfig
from microrl.rollout import HFRollout, SamplingParams
from microrl.rollout.episodes import PLAIN_CHAT_TEMPLATE, EpisodeError, ObservationRenderer
from microrl.run.toy_model import build_model, build_tokenizer
from microrl.tasks import HintedAdditionTask, Problem

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """Characters plus one merge, ``12``: sampling ``1``, ``2`` separately and re-encoding the
    text gives the merged id instead, the re-tokenization drift token in / token out avoids."""
    chars = list("0123456789+-=#*abcdefghijklmnopqrstuvwxyz \n")
    specials = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *chars, "12"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    tok.decoder = decoders.Fuse()
    eos = "<|im_end|>" if chat_template else "<eos>"
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token=eos, padding_side="left"
    )
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    out.chat_template = chat_template
    return out


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_token_in_token_out_keeps_the_sampled_ids_where_re_encoding_would_not():
    tok = bpe_tokenizer()
    one, two, eos = tok.convert_tokens_to_ids(["1", "2", "<eos>"])
    assert ids(tok, "12") == [tok.convert_tokens_to_ids("12")]  # re-encoding merges them
    backend = ScriptedBackend(tok, [[[one, two, eos]], [[one, eos]]])
    envs = []

    def make_env(i):
        envs.append(ScriptEnv(["ab"], [0.25, 1.0], done_at=2))
        return envs[-1]

    rollout = backend.run_episodes(
        ["x="], make_env, SamplingParams(max_new_tokens=8), max_turns=4, max_tokens=32
    )
    batch = rollout.batch
    prompt = ids(tok, "x=")
    observation = ids(tok, "ab")  # the plain template's delta: the observation's content
    expected = [*prompt, one, two, eos, *observation, one, eos]
    assert batch["input_ids"][0].tolist() == expected
    loss = [False] * len(prompt) + [True] * 3 + [False] * len(observation) + [True] * 2
    assert batch["loss_mask"][0].tolist() == loss
    assert batch["attention_mask"][0].all()
    lps = batch["rollout_logprobs"][0]
    assert lps[len(prompt) : len(prompt) + 3].tolist() == pytest.approx([-0.11, -0.21, -0.31])
    assert lps[-2:].tolist() == pytest.approx([-0.12, -0.22])
    assert (lps[~batch["loss_mask"][0]] == 0).all()
    # the second turn was sampled on the exact ids so far, not on a re-encoding of their text
    assert backend.calls[1][0] == [[*prompt, one, two, eos, *observation]]
    assert envs[0].actions == ["12", "1"] and envs[0].closed
    assert rollout.rewards.tolist() == [1.25] and rollout.num_turns.tolist() == [2]
    assert batch["truncated"].tolist() == [False]
    assert rollout.metrics == {
        "episodes/env_time_s": pytest.approx(0, abs=1),
        "episodes/env_errors": 0,
    }


def test_layout_groups_stops_and_truncation():
    """Two prompts x 2 rows: done at once, max_turns, a turn cut before <eos>, the budget."""
    tok = bpe_tokenizer()
    a, b, c, eos = tok.convert_tokens_to_ids(["a", "b", "c", "<eos>"])
    turns = [
        [[a, eos], [a, a, a], [b, eos], [b, eos]],  # row 1: cut by max_new_tokens=3
        [[b, eos], [b, eos], [b, b, eos]],  # rows 1, 2, 3 (row 0 is done)
        [[a, eos], [a, eos]],  # rows 1 (1 token of budget left), 2 (row 3 is out of budget)
    ]
    backend = ScriptedBackend(tok, turns)
    envs = iter(
        [
            ScriptEnv(["c"] * 3, [1.0] * 3, done_at=1),
            ScriptEnv(["c"] * 3, [1.0] * 3, done_at=5),
            ScriptEnv(["c"] * 3, [1.0] * 3, done_at=5),
            ScriptEnv(["c", "cccc"], [1.0] * 3, done_at=5),
        ]
    )
    rollout = backend.run_episodes(
        ["p=", "q=="], lambda i: next(envs), SamplingParams(num_samples=2, max_new_tokens=3),
        max_turns=3, max_tokens=9,
    )  # fmt: skip
    batch = rollout.batch
    assert rollout.group_ids.tolist() == [0, 0, 1, 1]
    assert rollout.num_turns.tolist() == [1, 3, 3, 2]
    assert rollout.rewards.tolist() == [1.0, 3.0, 3.0, 2.0]
    # done: not truncated; max_turns without done: truncated; the budget: truncated
    assert batch["truncated"].tolist() == [False, True, True, True]
    width = len(ids(tok, "q=="))
    row1 = batch["input_ids"][1, width:].tolist()
    # the cut turn gets its <eos> from the template, unmasked, before the observation; the last
    # turn is cut at the budget
    assert row1 == [a, a, a, eos, c, b, eos, c, a]
    assert batch["loss_mask"][1, width:].tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 1]
    # row 3: the 4-token observation after 6 tokens would overflow the budget: not added
    assert batch["input_ids"][3, width : width + 6].tolist() == [b, eos, c, b, b, eos]
    assert not batch["attention_mask"][3, width + 6 :].any()
    # prompts are left-padded to one column, trajectories right-padded
    assert batch["attention_mask"][0].tolist()[:width] == [False] + [True] * (width - 1)
    assert [p.max_new_tokens for _, p in backend.calls] == [3, 3, 3]


def test_a_long_turn_is_cut_at_the_token_budget():
    tok = bpe_tokenizer()
    a = tok.convert_tokens_to_ids("a")
    backend = ScriptedBackend(tok, [[[a] * 8]])
    rollout = backend.run_episodes(
        ["p="],
        lambda i: ScriptEnv([], [0.5], done_at=1),
        SamplingParams(max_new_tokens=8),
        max_turns=2,
        max_tokens=5,
    )
    assert rollout.batch["loss_mask"][0].sum() == 5
    assert backend.calls[0][1].max_new_tokens == 5
    assert rollout.rewards.tolist() == [0.5]  # the environment still scores the cut turn


def test_chat_template_observations_are_the_delta_after_the_assistant_turn():
    tok = bpe_tokenizer(CHATML)
    renderer = ObservationRenderer(tok)
    delta = renderer.observation([{"role": "user", "content": "ab"}], with_eos=False)
    expected = ids(tok, "\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n")
    assert delta == expected
    with_eos = renderer.observation([{"role": "tool", "content": "ab"}], with_eos=True)
    assert with_eos[0] == tok.eos_token_id
    prompt = renderer.prompt([{"role": "user", "content": "hi"}])
    assert prompt == ids(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # a template whose assistant turns end with another token than eos: that token ends turns
    tok.eos_token = "<eos>"
    renderer = ObservationRenderer(tok)
    assert renderer.turn_end_id == tok.convert_tokens_to_ids("<|im_end|>") != tok.eos_token_id
    assert renderer.observation([{"role": "user", "content": "ab"}], with_eos=False) == expected
    assert ObservationRenderer(bpe_tokenizer()).template == PLAIN_CHAT_TEMPLATE


def test_skyrl_gym_environments_run_unchanged():
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    tok = bpe_tokenizer(CHATML)
    eos = tok.eos_token_id
    wrong, right = [*ids(tok, "#### 5"), eos], [*ids(tok, "#### 7"), eos]
    backend = ScriptedBackend(tok, [[wrong, right], [right]])

    def make_env(i):
        return GSM8kMultiTurnEnv(extras={"reward_spec": {"ground_truth": "7"}, "max_turns": 3})

    prompt = [{"role": "user", "content": "three plus four"}]
    rollout = backend.run_episodes(
        [prompt], make_env, SamplingParams(num_samples=2, max_new_tokens=16), max_turns=5,
        max_tokens=200,
    )  # fmt: skip
    assert rollout.num_turns.tolist() == [2, 1]
    assert rollout.rewards[1] == 1.0 and 1.0 < rollout.rewards[0] < 1.2  # format score + right
    assert not rollout.batch["truncated"].any()
    assert "<|im_start|>user" in rollout.texts[0]


def test_environment_errors_are_named_or_skipped():
    tok = bpe_tokenizer()
    a, eos = tok.convert_tokens_to_ids(["a", "<eos>"])
    params = SamplingParams(num_samples=2, max_new_tokens=3)

    def make_env(i):
        return ScriptEnv(["c"], [1.0, 1.0], done_at=2, fail_at=1 if i == 1 else None)

    def run(skip: bool):
        backend = ScriptedBackend(tok, [[[a, eos]] * 4, [[a, eos]] * 4])
        return backend.run_episodes(
            ["p=", "q="], make_env, params, max_turns=3, max_tokens=10, skip_env_errors=skip
        )

    with pytest.raises(EpisodeError, match=r"row 2 \(prompt 1\) raised in step\(\) at turn 2"):
        run(skip=False)
    with pytest.raises(EpisodeError, match="the tool crashed") as err:
        run(skip=False)
    assert "Traceback" in str(err.value) and isinstance(err.value.__cause__, KeyError)
    rollout = run(skip=True)
    assert rollout.group_ids.tolist() == [0, 0]  # prompt 1's rows are dropped
    assert rollout.metrics["episodes/env_errors"] == 2.0

    def broken(i):
        raise RuntimeError("no such environment")

    with pytest.raises(EpisodeError, match="make_env"):
        ScriptedBackend(tok, []).run_episodes(["p="], broken, params, max_turns=1, max_tokens=4)
    with pytest.raises(EpisodeError, match="none is left"):
        ScriptedBackend(tok, []).run_episodes(
            ["p="], broken, params, max_turns=1, max_tokens=4, skip_env_errors=True
        )


def test_bad_arguments_and_malformed_environment_output_are_named():
    tok = bpe_tokenizer()
    a, eos = tok.convert_tokens_to_ids(["a", "<eos>"])
    backend = ScriptedBackend(tok, [[[a, eos]]])
    env = lambda i: ScriptEnv([], [1.0], done_at=1)  # noqa: E731
    params = SamplingParams()
    with pytest.raises(ValueError, match="max_turns"):
        backend.run_episodes(["p"], env, params, max_turns=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        backend.run_episodes(["p"], env, params, max_turns=1, max_tokens=0)
    with pytest.raises(ValueError, match="prompts"):
        backend.run_episodes([], env, params, max_turns=1, max_tokens=4)
    with pytest.raises(TypeError, match="make_env"):
        backend.run_episodes(["p"], "env", params, max_turns=1, max_tokens=4)
    with pytest.raises(TypeError, match="SamplingParams"):
        backend.run_episodes(["p"], env, {"greedy": True}, max_turns=1, max_tokens=4)

    class Malformed(ScriptEnv):
        def step(self, action):
            return ("obs", 1.0, True)

    with pytest.raises(TypeError, match="'done'"):
        backend.run_episodes(
            ["p"], lambda i: Malformed([], [], 1), params, max_turns=1, max_tokens=4
        )


def test_hf_episodes_are_scored_by_the_engine_at_the_sampled_log_probs():
    """The hinted-addition game on the toy model: the engine's log-probs of the episode batch
    (observations as context, several turns per row) are the sampler's, to fp32 rounding."""
    from microrl.configs import ActorConfig
    from microrl.engine import ActorEngine

    tok = build_tokenizer()
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)
    model = build_model(cfg, tok)
    engine = ActorEngine(model, ActorConfig(micro_batch_size=5, temperature=0.9))
    task = HintedAdditionTask(max_operand=99, eval_size=10)
    problems = [Problem("12+7=", "19"), Problem("3+4=", "7"), Problem("45+45=", "90")]
    torch.manual_seed(0)
    rollout = HFRollout(engine, tok).run_episodes(
        [p.prompt for p in problems],
        lambda i: task.make_env(problems[i]),
        SamplingParams(num_samples=3, temperature=0.9, max_new_tokens=4),
        max_turns=3,
        max_tokens=20,
    )
    batch = rollout.batch
    assert rollout.num_turns.max() > 1  # untrained: wrong guesses, hints, more turns
    scored = engine.infer_batch(batch)["logprobs"]
    mask = batch["loss_mask"]
    assert torch.allclose(scored[mask], batch["rollout_logprobs"][mask], atol=1e-5)
    observed = batch["attention_mask"] & ~mask
    hints = {tok.convert_tokens_to_ids(c) for c in "+-*"}
    width = len(tok("45+45=")["input_ids"])
    assert set(batch["input_ids"][:, width:][observed[:, width:]].tolist()) <= hints | {
        tok.eos_token_id
    }


def test_hinted_addition_environment():
    env = HintedAdditionTask(99, 10).make_env(Problem("12+7=", "19"))
    assert env.init("12+7=") == ("12+7=", {})
    first = env.step("18")
    assert first["observations"] == [{"role": "user", "content": "+"}] and not first["done"]
    assert env.step("x")["observations"][0]["content"] == "*"
    last = env.step("20")
    assert last["done"] and last["reward"] == 0.0 and last["observations"] == []
    fresh = HintedAdditionTask(99, 10).make_env(Problem("12+7=", "19"))
    assert fresh.step("19") == {"observations": [], "reward": 1.0, "done": True, "metadata": {}}
    assert fresh.hint("019") == "*" and fresh.hint("25") == "-"
