"""What the episode tests share: a backend that replays scripted turns, a scripted environment,
and small tokenizers with the chat templates of a few model families (hand-written, nothing
downloaded)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from microrl.rollout import RolloutBackend, Samples, SamplingParams


class ScriptedBackend(RolloutBackend):
    """Returns, per call, the next scripted turn of each row in order (ids, log-probs)."""

    def __init__(self, tokenizer, turns: list[list[list[int]]], generation_config=None) -> None:
        super().__init__(tokenizer, generation_config=generation_config)
        self.turns = turns
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []

    def _sample(self, prompt_ids, params) -> Samples:
        self.calls.append(([list(p) for p in prompt_ids], params))
        ids = self.turns[len(self.calls) - 1]
        assert len(ids) == len(prompt_ids)
        logprobs = [[-0.1 * (k + 1) - 0.01 * len(self.calls) for k in range(len(t))] for t in ids]
        return Samples(token_ids=[t[: params.max_new_tokens] for t in ids], logprobs=logprobs)


class ScriptEnv:
    """Answers with ``observations[turn]`` and ``rewards[turn]``; done after ``done_at`` turns."""

    def __init__(self, observations, rewards, done_at: int, fail_at: int | None = None) -> None:
        self.observations, self.rewards = observations, rewards
        self.done_at, self.fail_at = done_at, fail_at
        self.actions: list[str] = []
        self.closed = False

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str):
        self.actions.append(action)
        turn = len(self.actions) - 1
        if turn == self.fail_at:
            raise KeyError("the tool crashed")
        done = len(self.actions) >= self.done_at
        obs = [] if done else [{"role": "user", "content": self.observations[turn]}]
        return {"observations": obs, "reward": self.rewards[turn], "done": done, "metadata": {}}

    def close(self):
        self.closed = True


# Gemma: turns end with <end_of_turn>, the tokenizer's eos is <eos>; the assistant is "model".
GEMMA = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Llama 3: turns end with <|eot_id|>; a base tokenizer's eos is <|end_of_text|>.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
FAMILIES = {
    "gemma": (GEMMA, "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "llama3": (
        LLAMA3,
        "<|begin_of_text|>",
        "<|end_of_text|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    ),
}


def family_tokenizer(family: str, template: str | None = None) -> PreTrainedTokenizerFast:
    """A character tokenizer with ``family``'s special tokens and chat template (or ``template``)."""
    default, bos, eos, specials = FAMILIES[family]
    chars = list("0123456789+-=#*abcdefghijklmnopqrstuvwxyz \n")
    vocab = {t: i for i, t in enumerate(["<pad>", bos, eos, *specials, *chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token=bos, eos_token=eos, padding_side="left"
    )
    out.add_special_tokens({"additional_special_tokens": specials})
    out.chat_template = template or default
    return out
