"""The tokenizer and the tiny model of the examples, built locally: nothing is downloaded.

The tokenizer is a real one, built with the ``tokenizers`` library (one token per character over the
task's alphabet, a ``<bos>`` added by its post-processor) and wrapped as a transformers
``PreTrainedTokenizerFast``, so it saves, loads and pads like any hub tokenizer. The model
(``model.toy_arch``) is a small Llama-architecture decoder built from a config (biased attention
projections, as in Qwen2, and 32-wide heads, the narrowest vLLM's CPU attention runs, so the
``hf`` and ``vllm`` rollout backends both sample it), or a small Qwen3-MoE mixture of experts of
the same width and depth (:data:`MOE_EXPERTS` experts, top-:data:`MOE_TOP_K`, renormalised gate
weights as in the released checkpoints); any local transformers checkpoint can replace it
(``model.path``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from microrl.configs.run import ModelConfig

__all__ = [
    "MOE_EXPERTS",
    "MOE_TOP_K",
    "build_model",
    "build_tokenizer",
    "is_checkpoint",
    "load_pretrained",
    "load_tokenizer",
]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ALPHABET = "0123456789+-*= "  # digits, the operators a task may use, '=' and space
# The mixture-of-experts toy (model.toy_arch=moe): a few experts, each token through two of them.
MOE_EXPERTS = 4
MOE_TOP_K = 2


def build_tokenizer(
    extra_chars: str = "", extra_tokens: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over :data:`ALPHABET`; ``"12+7="`` -> ``<bos> 1 2 + 7 =``.

    ``extra_chars`` (a task's ``toy_alphabet``, e.g. the letters of word problems) are appended
    after :data:`ALPHABET`, skipping those it has: the ids of the addition task's characters, and
    with no extra characters the whole tokenizer, stay what they always were. ``extra_tokens``
    (a task's ``toy_tokens``, e.g. a chat template's role markers and ``<tool_call>``) come
    last, each one token; they are not *special* tokens, so decoding keeps them (a tool-call
    parser reads them in the decoded text).

    Padding is on the left so prompts of a batch end at the same column, which is what
    ``generate`` needs for a decoder-only model. Decoding fuses characters back without spaces.
    """
    extra = [c for c in dict.fromkeys(extra_chars) if c not in ALPHABET]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *ALPHABET, *extra])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )
    if extra_tokens:
        out.add_tokens(list(extra_tokens))
    return out


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialised toy decoder of ``cfg.toy_arch`` sized by ``cfg`` (seeded by
    ``cfg.seed``): a Llama-architecture one (``dense``) or a Qwen3-MoE (``moe``)."""
    shared = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        head_dim=cfg.head_dim or cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config_cls, model_cls, own = _ARCHS[cfg.toy_arch]
    config = config_cls(**shared, **own(cfg))
    # Built on the CPU: only its generator is forked (forking every GPU's would start a CUDA
    # context on each GPU of the machine, in every process).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_cls(config)
    return model


def _dense(cfg: ModelConfig) -> dict:
    return {"attention_bias": True}


def _moe(cfg: ModelConfig) -> dict:
    # Each of a token's k experts is intermediate_size / k wide: a token computes as much as
    # in the dense toy, with MOE_EXPERTS / k times its MLP parameters to choose from.
    return {
        "num_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_TOP_K,
        "moe_intermediate_size": max(1, cfg.intermediate_size // MOE_TOP_K),
        "norm_topk_prob": True,  # as Qwen3-30B-A3B's config (transformers defaults to False)
    }


# model.toy_arch -> (config class, model class, its keys beyond the shared ones).
_ARCHS = {
    "dense": (LlamaConfig, LlamaForCausalLM, _dense),
    "moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, _moe),
}


def is_checkpoint(path: str | Path) -> bool:
    """True when ``path`` holds a transformers model (its ``config.json``) and a tokenizer."""
    path = Path(path)
    return (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()


def load_pretrained(path: str | Path) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """Tokenizer and causal LM from a local checkpoint (float32, eval mode); never downloads."""
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return tokenizer, model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local checkpoint, left-padding, with a pad token; never downloads."""
    if not is_checkpoint(path):
        raise ValueError(f"model.path {str(path)!r} is not a local transformers checkpoint")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # many LM tokenizers ship without one
        if tokenizer.eos_token is None:
            raise ValueError(
                f"model.path {str(path)!r}: its tokenizer has neither a pad nor an eos token "
                "(the rollouts need an eos token to end responses)"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
