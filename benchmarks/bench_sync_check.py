"""The sync check's probe statistics on a realistic logit scale, bf16 emulated on the CPU.

    python benchmarks/bench_sync_check.py           # 2 setups, 4 probes: ~3 minutes on 2 cores
    python benchmarks/bench_sync_check.py --all     # + a 152k-vocabulary LoRA setup, bf16 noise
                                                    #   against depth (2-16 layers): ~30 minutes

A weight push to a sampler is verified by scoring a fixed probe batch
(``microrl.rollout.weights.sync_check.build_probe``: random tokens) on both sides. Per probe,
this measures ``max |d|``, ``mean |d|`` and the k3 statistic of ``d = trainer - sampler`` (the
trainer: ``ActorEngine.infer_batch``, with its fp32 fused head; the sampler: the ``hf`` worker's
plain forward under the engine's autocast, or a copy stored in bf16 as a vLLM server holds it)
for the same weights (the noise a tolerance must pass), for weights one optimizer step stale,
and for gross failures (a sampler far behind, a tensor lost). Models are built from configs of
realistic shape (Llama's 32k vocabulary untied, Qwen2.5-0.5B's widths and 152k vocabulary tied;
few layers), randomly initialised, their final norm scaled so the largest logit of a position
is ~22 on average (a trained LM's range, where bf16 rounds a logit by up to 0.06); nothing is
downloaded. A step is AdamW's first (``lr * g / |g|``: exact for zero weight decay) on a
policy-gradient loss, taken by the engine and scaled to the learning rate of each row.
"""

from __future__ import annotations

import argparse
import copy
import time
import types
from collections.abc import Callable

import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import ActorEngine
from microrl.losses import broadcast_to_tokens
from microrl.rollout.samplers.hf import engine_autocast_dtype
from microrl.rollout.weights.sync_check import build_probe, probe_stats
from microrl.rollout.worker.main import score_probe

TOKENIZER = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
ROWS = 4  # rows of one probe (build_probe)
KEYS = ("sync/probe_abs_diff_max", "sync/probe_abs_diff_mean", "sync/probe_kl")


def _arch(name: str, layers: int):
    if name == "llama-32k":  # Llama-2's vocabulary, TinyLlama-like widths, untied head
        return LlamaConfig(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            max_position_embeddings=256,
        )
    return Qwen2Config(  # Qwen2.5-0.5B's widths and vocabulary, tied head
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )


def build_model(arch: str, layers: int, seed: int, top_logit: float) -> torch.nn.Module:
    """A random model whose largest logit per position averages ``top_logit`` (the final norm
    scaled)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_arch(arch, layers)).eval()
    probe = build_probe(model.config.vocab_size, 256, TOKENIZER, seed=10_000 + seed)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
        model.model.norm.weight *= top_logit / logits.max(-1).values.mean()
    return model


def stacked_probes(vocab: int, count: int) -> TensorDict:
    """``count`` probes (seeds 0..count-1) stacked: one forward scores them all."""
    return torch.cat([build_probe(vocab, 256, TOKENIZER, seed=s) for s in range(count)], dim=0)


def per_probe(expected: torch.Tensor, actual: torch.Tensor, probe: TensorDict) -> list[dict]:
    """The sync check's :func:`probe_stats` of each probe of a stack."""
    mask = probe["loss_mask"]
    return [
        probe_stats(expected[i : i + ROWS], actual[i : i + ROWS], mask[i : i + ROWS])
        for i in range(0, expected.shape[0], ROWS)
    ]


def hf_worker(model, probe, autocast_dtype) -> torch.Tensor:
    """What the ``hf`` worker scores: a plain forward under the engine's autocast."""
    return score_probe(model, probe, 1.0, autocast_dtype)


_TWINS: dict[int, torch.nn.Module] = {}


def bf16_copy(model, probe, autocast_dtype) -> torch.Tensor:
    """A sampler holding every weight in bf16 (a vLLM server's ``dtype=bfloat16``): bf16
    residual stream and bf16 logits (one bf16 twin per model, its weights copied in)."""
    twin = _TWINS.get(id(model))
    if twin is None:
        twin = _TWINS[id(model)] = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        twins = dict(twin.named_parameters())
        for name, param in model.named_parameters():
            twins[name].copy_(param)
    return score_probe(twin, probe, 1.0)


def trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def first_step(engine, seed: int) -> dict[str, torch.Tensor]:
    """AdamW's first update of each trained tensor at lr 1 (linear in the learning rate), on a
    policy-gradient loss over random tokens with random advantages."""
    before = trained(engine.model)
    vocab = engine.vocab_size
    batch = torch.cat([build_probe(vocab, 256, TOKENIZER, seed=20_000 + seed + i) for i in (0, 1)])
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    advantages = torch.randn(batch.batch_size[0], generator=torch.Generator().manual_seed(seed))
    batch["advantages"] = broadcast_to_tokens(advantages, batch["loss_mask"])
    lr = 1e-3
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    assert engine.train_batch(batch)["step_skipped"] == 0
    after = trained(engine.model)
    return {n: (after[n] - before[n]) / lr for n in before}


@torch.no_grad()
def set_weights(model, base, update, lr: float, *, skip=(), zero=()) -> None:
    """``base + lr * update`` (``skip``: left at ``base``; ``zero``: zeroed, a lost tensor)."""
    params = dict(model.named_parameters())
    for name, value in base.items():
        params[name].copy_(value if name in skip else value + lr * update[name])
    for name in zero:
        params[name].zero_()


def run_setup(args, arch, layers, seed, config, lr, samplers) -> list[tuple[str, list[dict]]]:
    """Rows ``(case, per-probe stats)`` for one model, one engine precision and its samplers."""
    model = build_model(arch, layers, seed, args.top_logit)
    probe = stacked_probes(model.config.vocab_size, args.probes)
    engine = ActorEngine(model, config)
    dtype = engine_autocast_dtype(engine)
    with torch.no_grad():
        logits = engine.model(input_ids=probe["input_ids"]).logits
    print(
        f"logits: largest per position {logits.max(-1).values.mean():.1f} on average, "
        f"std {logits.std():.2f}; p(top token) {logits.softmax(-1).max(-1).values.mean():.2f}",
        flush=True,
    )
    base = trained(engine.model)
    update = first_step(engine, seed)
    one = next(n for n in base if "layers.0.self_attn.q_proj" in n and "lora_A" not in n)
    lost = "model.layers.0.self_attn.q_proj.weight"  # a full push that lost one tensor
    set_weights(engine.model, base, update, lr)
    trainer = engine.infer_batch(probe)["logprobs"]
    worker = copy.deepcopy(engine.model)
    cases: list[tuple[str, dict]] = [
        ("same weights", {}),
        (f"one step stale (lr {lr:g})", {"lr": 0.0}),
        (f"one tensor one step stale ({one})", {"skip": {one}}),
        ("100 steps stale (the step x100)", {"lr": -99 * lr}),
    ]
    if config.lora.rank == 0:
        cases.append((f"one tensor lost (zero): {lost}", {"zero": {lost}}))
    rows = []
    for name, sampler in samplers:
        for case, change in cases:
            set_weights(
                worker,
                base,
                update,
                change.get("lr", lr),
                skip=change.get("skip", ()),
                zero=change.get("zero", ()),
            )
            rows.append(
                (f"{name}: {case}", per_probe(trainer, sampler(worker, probe, dtype), probe))
            )
    return rows


def table(rows: list[tuple[str, list[dict]]]) -> None:
    print("\n| sampler: weights | max \\|d\\| | mean \\|d\\| | k3 |")
    print("|---|---|---|---|")
    for case, stats in rows:
        cells = []
        for key in KEYS:
            values = [s[key] for s in stats]
            cells.append(f"{min(values):.2g} - {max(values):.2g}")
        print(f"| {case} | " + " | ".join(cells) + " |", flush=True)


def setups(args) -> list[tuple[str, str, int, int, ActorConfig, float, list]]:
    """The default: float32 and bf16 autocast full fine-tunes of the Llama model; ``--all``:
    also a LoRA engine with a bf16 base on the Qwen2 model (152k vocabulary)."""
    fp32 = ActorConfig(dtype="float32", micro_batch_size=8)
    full = ActorConfig(dtype="bfloat16", micro_batch_size=8)
    lora = ActorConfig(dtype="bfloat16", base_dtype="bfloat16", lora=LoraConfig(rank=16, alpha=32))
    hf: tuple[str, Callable] = ("hf worker", hf_worker)
    bf16: tuple[str, Callable] = ("bf16 copy", bf16_copy)
    runs = [
        ("float32, full fine-tune", "llama-32k", 4, 0, fp32, 1e-6, [hf]),
        ("bf16 autocast, fp32 weights, full fine-tune", "llama-32k", 4, 0, full, 1e-5, [hf, bf16]),
    ]
    if args.all:
        runs.append(
            ("bf16 autocast, bf16 base, LoRA rank 16", "qwen2-152k", 2, 0, lora, 1e-4, [hf, bf16])
        )
    return runs


def depth(args) -> None:
    """The bf16 noise (same weights) against depth: bf16 copy vs the autocast engine."""
    print("\nbf16 noise against depth (llama-32k, bf16 autocast engine vs bf16 copy)", flush=True)
    print("\n| layers | max \\|d\\| | mean \\|d\\| | k3 |\n|---|---|---|---|")
    for layers in (2, 4, 8, 16):
        model = build_model("llama-32k", layers, 0, args.top_logit)
        probe = stacked_probes(model.config.vocab_size, args.probes)
        engine = ActorEngine(model, ActorConfig(dtype="bfloat16", micro_batch_size=8))
        stats = per_probe(
            engine.infer_batch(probe)["logprobs"], bf16_copy(engine.model, probe, None), probe
        )
        cells = [f"{min(s[k] for s in stats):.2g} - {max(s[k] for s in stats):.2g}" for k in KEYS]
        print(f"| {layers} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=4, help="probes (4 rows each) per setup")
    parser.add_argument("--top-logit", type=float, default=22.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--all", action="store_true", help="also the 152k-vocabulary LoRA setup and the depth rows"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for title, arch, layers, seed, config, lr, samplers in setups(args):
        start = time.perf_counter()
        print(f"\n{title}: {arch}, {layers} layers, {args.probes} probes", flush=True)
        table(run_setup(args, arch, layers, seed, config, lr, samplers))
        print(f"\n({time.perf_counter() - start:.0f} s)", flush=True)
    if args.all:
        depth(args)


if __name__ == "__main__":
    main()
