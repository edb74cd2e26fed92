"""Rollout throughput: the vllm backend against HF ``generate``, same model, same prompts.

    python benchmarks/bench_rollout.py
    python benchmarks/bench_rollout.py --hidden 512 --layers 4 --vocab 32000 --prompts 64

Builds a random Qwen2 (nothing downloaded) under an ActorEngine with LoRA, as the recipes do, and
samples ``--samples`` responses to each of ``--prompts`` random prompts of ``--prompt-len`` tokens
with each backend, up to ``max_new_tokens`` each (the EOS id is the last of the vocabulary, which a
random model samples with probability ~1/V per token: nearly every response is full length, and
throughput counts the response tokens each backend actually produced). The time is
the median over ``--repeats`` calls after a warm-up call (vLLM compiles on its first), and the
ratio is measured in the same run. Needs vLLM (docs/rollouts.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from microrl.configs import ActorConfig, LoraConfig
from microrl.configs.rollout import VLLMConfig
from microrl.engine import ActorEngine
from microrl.rollout import HFRollout, SamplingParams, VLLMRollout


def _tokenizer(vocab: int):
    """A stand-in tokenizer: ids only (the benchmark passes token ids, decodes nothing useful)."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"pad_token": "t0", "eos_token": f"t{vocab - 1}"})
    return fast


def _time(backend, prompts, params, repeats: int) -> tuple[float, int]:
    backend.generate(prompts, params)  # warm-up (vLLM compiles here)
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        rollout = backend.generate(prompts, params)
        times.append(time.perf_counter() - start)
        tokens = int(rollout.batch["loss_mask"].sum())
    return statistics.median(times), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-dtype", default="auto", help="VLLMConfig.dtype")
    parser.add_argument(
        "--compile", action="store_true", help="let vLLM compile (enforce_eager=False)"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.prompt_len + args.max_new_tokens,
    )
    tokenizer = _tokenizer(args.vocab)
    engine = ActorEngine(Qwen2ForCausalLM(config), ActorConfig(lora=LoraConfig(rank=8)))
    prompts = torch.randint(1, args.vocab - 1, (args.prompts, args.prompt_len)).tolist()
    params = SamplingParams(num_samples=args.samples, max_new_tokens=args.max_new_tokens)
    rows = []
    hf_time, hf_tokens = _time(HFRollout(engine, tokenizer), prompts, params, args.repeats)
    rows.append(("hf (transformers generate)", hf_time, hf_tokens))
    vllm_config = VLLMConfig(dtype=args.vllm_dtype, enforce_eager=not args.compile)
    vllm = VLLMRollout(engine, tokenizer, vllm_config)
    try:
        vllm_time, vllm_tokens = _time(vllm, prompts, params, args.repeats)
    finally:
        vllm.close()
    rows.append(
        (f"vllm (in process, {args.vllm_dtype}, eager={not args.compile})", vllm_time, vllm_tokens)
    )
    print(
        f"Qwen2 H={args.hidden} layers={args.layers} heads={args.heads} V={args.vocab}, "
        f"{args.prompts} prompts x {args.samples} samples, {args.prompt_len} prompt + "
        f"{args.max_new_tokens} new tokens, threads={torch.get_num_threads()}"
    )
    print("| backend | s per rollout | response tokens | tokens/s | vs hf |")
    print("|---|---|---|---|---|")
    for name, seconds, tokens in rows:
        print(
            f"| {name} | {seconds:.2f} | {tokens} | {tokens / seconds:,.0f} | "
            f"{(tokens / seconds) / (hf_tokens / hf_time):.2f}x |"
        )


if __name__ == "__main__":
    main()
