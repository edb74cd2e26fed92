"""What the agent tests share: a chat tokenizer whose re-encoding drifts, a byte-level one, a
tiny model on it, backends that record (or script) what they sample, and the check that rows are
exact."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from microrl.configs.run import ModelConfig
from microrl.rollout import HFRollout, Rollout, RolloutBackend, Samples
from microrl.run.toy_model import build_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """ChatML over characters plus one merge, ``12``: sampling ``1``, ``2`` separately and
    re-encoding the text gives the merged id instead (the drift the endpoint avoids)."""
    chars = list('0123456789+-=#*abcdefghijklmnopqrstuvwxyz{}[]":,_ \n')
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, *chars, "12"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", padding_side="left"
    )
    out.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    out.chat_template = CHATML
    return out


def byte_tokenizer(specials: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """ChatML over byte-level BPE with no merge (GPT-2's and Qwen's byte alphabet): every byte
    is a token, so a character of 2 to 4 UTF-8 bytes spans 2 to 4 tokens; ``specials`` are
    more special tokens (e.g. tool-call tags)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    chat = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*chat, *specials, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", padding_side="left"
    )
    out.add_special_tokens({"additional_special_tokens": [*chat[1:], *specials]})
    out.chat_template = CHATML
    return out


class RecordingHF(HFRollout):
    """The ``hf`` backend on a tiny model, recording each call's prompts and raw samples."""

    def __init__(self, tokenizer) -> None:
        cfg = ModelConfig(
            hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_positions=512
        )
        super().__init__(build_model(cfg, tokenizer).eval(), tokenizer)
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    def _sample(self, prompt_ids, params) -> Samples:
        samples = super()._sample(prompt_ids, params)
        for prompt, ids, lps in zip(prompt_ids, samples.token_ids, samples.logprobs, strict=True):
            self.calls.append((list(prompt), list(ids), list(lps)))
        return samples


class ScriptedBackend(RolloutBackend):
    """Answers every call with ``turns[k]`` (the k-th call, wrapping), log-probs ``-0.1 * k``."""

    def __init__(self, tokenizer, turns: list[list[int]]) -> None:
        super().__init__(tokenizer)
        self.turns = turns
        self.calls: list[tuple[list[int], list[int], list[float]]] = []
        self.batches: list[int] = []

    def _sample(self, prompt_ids, params) -> Samples:
        self.batches.append(len(prompt_ids))
        out = Samples([], [])
        for prompt in prompt_ids:
            ids = self.turns[len(self.calls) % len(self.turns)][: params.max_new_tokens]
            lps = [-0.1 * (len(self.calls) + 1)] * len(ids)
            self.calls.append((list(prompt), list(ids), lps))
            out.token_ids.append(list(ids))
            out.logprobs.append(lps)
        return out


def rows(rollout: Rollout) -> list[tuple[list[int], list[bool], list[float]]]:
    """Each row's ids, loss mask and rollout log-probs where attended."""
    batch, out = rollout.batch, []
    for i in range(batch.batch_size[0]):
        keep = batch["attention_mask"][i].bool()
        out.append(
            (
                batch["input_ids"][i][keep].tolist(),
                batch["loss_mask"][i][keep].tolist(),
                batch["rollout_logprobs"][i][keep].tolist(),
            )
        )
    return out


def assert_rows_exact(rollout: Rollout, calls, eos: int) -> int:
    """Every sampled segment of every row is one backend call's output, cut after its first
    ``eos`` (or at the call's limit), right after the very prompt that call was given, with its
    log-probs. Returns the number of sampled segments."""
    segments = 0
    for ids, mask, lps in rows(rollout):
        t = 0
        while t < len(ids):
            if not mask[t]:
                t += 1
                continue
            end = t
            while end < len(ids) and mask[end]:
                end += 1
            found = [
                k
                for k, (prompt, out, out_lps) in enumerate(calls)
                if ids[:t] == prompt
                and out[: end - t] == ids[t:end]
                and (eos not in out[: end - t - 1])
                and torch.allclose(torch.tensor(out_lps[: end - t]), torch.tensor(lps[t:end]))
            ]
            assert found, f"row segment {ids[t:end]} after {ids[:t]} is no sampled output"
            segments += 1
            t = end
    return segments
