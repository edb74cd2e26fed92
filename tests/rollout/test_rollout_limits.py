"""Prompts a rollout cannot sample: one of no token, and rows past the model's positions.

An empty prompt with a tokenizer that adds no BOS (Qwen2's) gave a row whose response starts
at its first position, which the engine refused steps later without naming the prompt. A prompt
plus ``rollout.max_new_tokens`` past the model's positions made GPT-2 fail with an
``IndexError`` inside its embedding and a RoPE model (Llama) run on silently.
"""

from __future__ import annotations

import pytest
from tokenizers import processors
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from microrl.rollout import HFRollout, SamplingParams
from microrl.rollout.base import encode_prompts
from microrl.rollout.positions import position_limit
from microrl.run.toy_model import build_tokenizer

POSITIONS = 16
PROMPT = "12+34=1234"  # 11 tokens with the toy tokenizer's <bos>


def test_a_prompt_of_no_token_is_refused_naming_it() -> None:
    tokenizer = build_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    assert tokenizer("")["input_ids"] == []  # no BOS, as Qwen2's tokenizer
    with pytest.raises(ValueError, match=r"prompt 1 \(''\) encodes to no token"):
        encode_prompts(tokenizer, ["1+1=", ""])
    assert encode_prompts(tokenizer, ["1+1="]) == [tokenizer("1+1=")["input_ids"]]


def _tiny(arch: str, tokenizer):
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if arch == "gpt2":  # a learned position table
        config = GPT2Config(
            vocab_size=len(tokenizer), n_positions=POSITIONS, n_embd=32, n_layer=1, n_head=2, **ids
        )
        return GPT2LMHeadModel(config), "n_positions"
    config = LlamaConfig(  # rotary positions
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=POSITIONS,
        **ids,
    )
    return LlamaForCausalLM(config), "max_position_embeddings"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_rows_past_the_models_positions_are_refused_before_sampling(arch: str) -> None:
    tokenizer = build_tokenizer()
    model, attribute = _tiny(arch, tokenizer)
    assert position_limit(model.config) == (POSITIONS, attribute)
    rollout = HFRollout(model, tokenizer)
    prompt_tokens = len(tokenizer(PROMPT)["input_ids"])
    fits = POSITIONS - prompt_tokens
    # Exactly the model's positions: sampled (no false refusal at the limit).
    ok = rollout.generate([PROMPT, "1+1="], SamplingParams(num_samples=2, max_new_tokens=fits))
    assert ok.batch["input_ids"].shape[1] <= POSITIONS
    message = (
        rf"the longest prompt has {prompt_tokens} tokens: with rollout.max_new_tokens={fits + 1} "
        rf"a row reaches {POSITIONS + 1} positions, past the model's {POSITIONS} "
        rf"\(config.{attribute}\)"
    )
    with pytest.raises(ValueError, match=message):
        rollout.generate([PROMPT], SamplingParams(num_samples=2, max_new_tokens=fits + 1))
