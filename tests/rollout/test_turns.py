"""Turn terminators beyond ``tokenizer.eos_token`` (microrl/rollout/turns.py): read from the chat
template and ``generation_config``, used by the samplers' stops, the rollout layout and the
observation deltas of episodes, on hand-written Gemma and Llama 3 templates.
"""

from __future__ import annotations

import pytest
from episode_utils import ScriptedBackend, ScriptEnv, family_tokenizer
from tokenizers import Tokenizer, decoders, models
from transformers import GenerationConfig, PreTrainedTokenizerFast

from microrl.configs.run import ModelConfig
from microrl.rollout import HFRollout, SamplingParams, turn_terminators
from microrl.rollout.episodes import ObservationRenderer
from microrl.rollout.samplers.vllm_options import sampling_args
from microrl.rollout.turns import template_turn_end
from microrl.run.toy_model import build_model, build_tokenizer

TURN_ENDS = {"gemma": "<end_of_turn>", "llama3": "<|eot_id|>"}
# what each template writes after a turn end, up to the next model turn, for a user message "c"
DELTAS = {
    "gemma": "\n<start_of_turn>user\nc<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nc<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", ["gemma", "llama3"])
def test_terminators_come_from_the_template_eos_and_generation_config(family):
    tok = family_tokenizer(family)
    end = tok.convert_tokens_to_ids(TURN_ENDS[family])
    assert end != tok.eos_token_id
    assert template_turn_end(tok).token_id == end
    assert turn_terminators(tok) == (end, tok.eos_token_id)
    # a model's generation_config lists them too (an int or a list): each once, template's first
    config = GenerationConfig(eos_token_id=[tok.eos_token_id, end])
    assert turn_terminators(tok, config) == (end, tok.eos_token_id)
    other = tok.convert_tokens_to_ids("#")
    assert turn_terminators(tok, GenerationConfig(eos_token_id=other)) == (
        end, tok.eos_token_id, other,
    )  # fmt: skip
    for bad in (len(tok), -1, "<eos>", [end, None]):
        with pytest.raises(ValueError, match=r"generation_config\.eos_token_id"):
            turn_terminators(tok, GenerationConfig(eos_token_id=bad))
    # no template: the plain one, whose turns end with eos, as before
    toy = build_tokenizer()
    assert turn_terminators(toy) == (toy.eos_token_id,)


def test_templates_without_a_separate_turn_end_are_refused():
    tok = family_tokenizer("gemma", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="writes nothing after an assistant turn"):
        turn_terminators(tok)
    # a backend samples text prompts without it (eos ends turns); its episodes refuse it
    assert turn_terminators(tok, require_template=False) == (tok.eos_token_id,)
    backend = ScriptedBackend(tok, [[[tok.eos_token_id]]])
    assert backend.stop_token_ids == (tok.eos_token_id,)
    with pytest.raises(ValueError, match="writes nothing after an assistant turn"):
        backend.run_episodes(
            ["p"], lambda i: ScriptEnv([], [1.0], 1), SamplingParams(), max_turns=1, max_tokens=4
        )
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match=r"fails on a plain.*roles must alternate"):
        turn_terminators(tok)
    tok.chat_template = "{% for m in messages %}<start_of_turn>{% endfor %}"
    with pytest.raises(ValueError, match="does not render an assistant message's content"):
        turn_terminators(tok)
    # a turn end that BPE merges with the content ("y!" is one token) cannot be told apart
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "x", "y", "z", "!", "y!"])}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("y", "!")], unk_token=None))
    bpe.decoder = decoders.Fuse()
    merging = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    merging.chat_template = "{% for m in messages %}{{ m['content'] }}!{% endfor %}"
    with pytest.raises(ValueError, match="not a token of its own"):
        turn_terminators(merging)


@pytest.mark.parametrize("family", ["gemma", "llama3"])
def test_episode_turns_end_at_the_template_turn_end(family):
    """A turn ends at the template's turn end (tokens sampled past it dropped) or at eos; a turn
    cut by max_new_tokens gets the template's turn end, unmasked; an observation is the delta
    after the turn end; every terminator is trained on."""
    tok = family_tokenizer(family)
    end, eos = tok.convert_tokens_to_ids(TURN_ENDS[family]), tok.eos_token_id
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    turns = [[[a, b, end, a]], [[a, a, a]], [[b, eos]]]
    backend = ScriptedBackend(tok, turns)
    env = ScriptEnv(["c", "c"], [0.0, 0.0, 1.0], done_at=3)
    prompt = [{"role": "user", "content": "p"}]
    rollout = backend.run_episodes(
        [prompt], lambda i: env, SamplingParams(max_new_tokens=3), max_turns=4, max_tokens=64
    )
    first = ObservationRenderer(tok).prompt(prompt)
    delta = ids(tok, DELTAS[family])
    row = [a, b, end, *delta, a, a, a, end, *delta, b, eos]
    batch = rollout.batch
    assert batch["input_ids"][0].tolist() == [*first, *row]
    masked = [1, 1, 1, *[0] * len(delta), 1, 1, 1, 0, *[0] * len(delta), 1, 1]
    assert batch["loss_mask"][0, len(first) :].tolist() == masked
    assert env.actions == ["ab", "aaa", "b"] and rollout.rewards.tolist() == [1.0]
    assert not batch["truncated"][0]
    # the samples were drawn on the exact ids so far, turn ends included
    assert backend.calls[2][0] == [[*first, *row[:-2]]]


@pytest.mark.parametrize("family", ["gemma", "llama3"])
def test_generate_cuts_responses_after_any_terminator(family):
    tok = family_tokenizer(family)
    end, eos = tok.convert_tokens_to_ids(TURN_ENDS[family]), tok.eos_token_id
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    backend = ScriptedBackend(tok, [[[a, end, b], [a, eos, b], [a, a, a]]])
    rollout = backend.generate(["p", "q", "p"], SamplingParams(max_new_tokens=3))
    batch = rollout.batch
    width = len(tok("p")["input_ids"])
    assert batch["loss_mask"][:, width:].tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1]]
    pad = tok.pad_token_id
    assert batch["input_ids"][:2, width:].tolist() == [[a, end, pad], [a, eos, pad]]
    assert batch["truncated"].tolist() == [False, False, True]


def test_samplers_stop_at_every_terminator():
    """``hf``: ``generate`` stops at the generation config's ids (here: every token, so every
    response is one token long, and ends a turn); vLLM gets them as ``stop_token_ids``."""
    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), tok)
    model.generation_config.eos_token_id = list(range(len(tok)))
    backend = HFRollout(model, tok)
    assert backend.stop_token_ids[0] == tok.eos_token_id
    assert set(backend.stop_token_ids) == set(range(len(tok)))
    rollout = backend.generate(["1+2="], SamplingParams(num_samples=4, max_new_tokens=5))
    assert rollout.batch["loss_mask"].sum(1).tolist() == [1, 1, 1, 1]
    assert not rollout.batch["truncated"].any()
    params = SamplingParams(max_new_tokens=4)
    assert sampling_args(params, seed=1, eos_token_id=(7, 3))["stop_token_ids"] == [7, 3]
    assert sampling_args(params, seed=1, eos_token_id=7)["stop_token_ids"] == [7]
