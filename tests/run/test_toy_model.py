"""The examples' toy tokenizer (microrl/run/toy_model.py): a real fast tokenizer that round-trips
and saves, with the padding side and special tokens the rollouts rely on."""

from __future__ import annotations

from pathlib import Path

from microrl.run.toy_model import build_tokenizer


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


def test_extra_tokens_are_whole_tokens_kept_by_decoding(tmp_path: Path) -> None:
    """A task's ``toy_tokens`` (chat role markers, ``<tool_call>``): one id each, after every
    character, so the plain tokenizer's ids do not move; decoding keeps them (a tool-call parser
    reads them), and they survive save and load."""
    from microrl.run.toy_model import load_tokenizer

    plain = build_tokenizer("abc")
    tok = build_tokenizer("abc", ["<tool_call>", "</tool_call>"])
    assert len(tok) == len(plain) + 2
    text = "<tool_call>ab</tool_call>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == [len(plain), plain.convert_tokens_to_ids("a"), plain.convert_tokens_to_ids("b"),
                   len(plain) + 1]  # fmt: skip
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok("12+ab=")["input_ids"] == plain("12+ab=")["input_ids"]
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path)(text, add_special_tokens=False)["input_ids"] == ids


def test_building_the_toy_model_touches_no_gpu(monkeypatch) -> None:
    """On a GPU machine the toy model is built on the CPU: forking every GPU's generator for its
    seed would start a CUDA context on each GPU, in every process of a run."""
    import torch

    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model, build_tokenizer

    def no_gpu(*args, **kwargs):
        raise AssertionError("a GPU's generator was touched")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state", no_gpu)
    tokenizer = build_tokenizer()
    config = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2)
    first = build_model(config, tokenizer)
    again = build_model(config, tokenizer)  # the seed alone decides the weights
    assert all(
        torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters(), strict=True)
    )


def test_the_moe_toy_is_a_qwen3_moe_the_engine_routes() -> None:
    """``model.toy_arch=moe``: a Qwen3-MoE of the dense toy's width, depth and tokens, its gate
    weights renormalised over the top 2 of 4 experts (as the released checkpoints, unlike
    transformers' default), whose routers the engine finds; a token computes as much as in the
    dense toy (2 experts of half its MLP width). An unknown architecture names the key."""
    import pytest
    import torch
    from transformers import Qwen3MoeForCausalLM

    from microrl.configs.run import TOY_ARCHS, ModelConfig
    from microrl.engine.moe import find_routers
    from microrl.run import toy_model
    from microrl.run.toy_model import MOE_EXPERTS, MOE_TOP_K, build_model, build_tokenizer

    assert set(TOY_ARCHS) == set(toy_model._ARCHS)
    tokenizer = build_tokenizer()
    sizes = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)
    model = build_model(ModelConfig(toy_arch="moe", **sizes), tokenizer)
    assert isinstance(model, Qwen3MoeForCausalLM)
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok) == (MOE_EXPERTS, MOE_TOP_K) == (4, 2)
    assert config.norm_topk_prob and config.moe_intermediate_size * MOE_TOP_K == 64
    assert config.vocab_size == len(tokenizer) and config.pad_token_id == tokenizer.pad_token_id
    assert len(find_routers(model)) == 2
    batch = tokenizer(["1+2=", "12+7="], return_tensors="pt", padding=True)
    assert torch.isfinite(model(**batch).logits).all()
    with pytest.raises(ValueError, match=r"^model\.toy_arch must be one of dense, moe"):
        ModelConfig(toy_arch="sparse")
