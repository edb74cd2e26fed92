"""The fused policy-loss path on CPU, as ratios measured in the same run (issue 12).

    python benchmarks/bench_fused_loss.py            # both parts, ~4-6 minutes on 2 busy cores
    python benchmarks/bench_fused_loss.py --quick    # smaller sizes, a smoke run
    python benchmarks/bench_fused_loss.py --only kernel   # or --only engine

1. Kernel + loss: a GRPO loss (PPO clip, token-mean, k3 KL to a reference) on N tokens (rows of
   ``--seq-len`` tokens) of an lm head ``[V, H]``, forward + backward, three ways:
   ``fused`` (:func:`microrl.kernels.fused_linear_loss`, the loss run per group of whole rows
   inside the head, gradients formed in forward), ``kernel+loss`` (today's
   ``fused_linear_logprob`` then ``policy_loss`` then backward) and ``eager``
   (``reference_linear_logprob``: full logits, autograd), for a frozen head (LoRA: only the
   hidden states get a gradient) and a trainable one. Liger-Kernel's chunked GRPO loss joins as
   a peer when it imports (it needs triton, so on a CPU-only machine it is reported as absent).
2. A GRPO LoRA ``train_batch`` of a shallow model whose head matters (V=32768, H=512), with
   ``fuse_loss`` on and off, on the same weights and batch.

Timings are the minimum over interleaved repetitions (A, B, C, A, B, C, ...) after one warm-up
each: load from other processes only ever adds time, and it hits every variant alike.
"""

from __future__ import annotations

import argparse
import time

import torch
from tensordict import TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM

from microrl.configs import ActorConfig, LoraConfig, PolicyLossConfig
from microrl.engine import ActorEngine
from microrl.kernels import fused_linear_logprob, fused_linear_loss, reference_linear_logprob
from microrl.losses import LossDenominators, policy_loss

GRPO = PolicyLossConfig(name="grpo", kl_coef=0.04)


def timed(variants: dict, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def loss_inputs(rows: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    mask[:, seq_len // 4 :] = True  # the response: the last three quarters of each row
    return {
        "targets": torch.randint(0, vocab, (rows, seq_len), generator=gen),
        "loss_mask": mask,
        "old": -torch.rand(rows, seq_len, generator=gen) * 3 - 9,
        "ref": -torch.rand(rows, seq_len, generator=gen) * 3 - 9,
        "adv": torch.randn(rows, 1, generator=gen).expand(rows, seq_len).contiguous(),
    }


def grpo_loss(lp: torch.Tensor, inputs: dict, rows: slice, den: LossDenominators):
    return policy_loss(
        lp,
        inputs["old"][rows],
        inputs["adv"][rows],
        inputs["loss_mask"][rows],
        den,
        GRPO,
        "token-mean",
        ref_logprobs=inputs["ref"][rows],
        validate=False,
    )


def bench_kernel(n: int, hidden: int, vocab: int, seq_len: int, reps: int) -> dict:
    rows = n // seq_len
    torch.manual_seed(0)
    h = torch.randn(rows, seq_len, hidden) * 0.5
    w = torch.randn(vocab, hidden) * (0.5 / hidden**0.5)
    inputs = loss_inputs(rows, seq_len, vocab)
    count = inputs["loss_mask"].sum().float()
    den = LossDenominators(count, torch.tensor(float(rows)))
    every = slice(None)
    liger = _liger_loss()
    results = {}
    for frozen in (True, False):
        hidden_leaf = h.clone().requires_grad_()
        weight = w.clone().requires_grad_(not frozen)

        def zero(hidden_leaf=hidden_leaf, weight=weight):
            hidden_leaf.grad = None
            weight.grad = None

        def fused(hidden_leaf=hidden_leaf, weight=weight):
            zero()

            def group(start, end, lp, _ent):
                r = slice(start // seq_len, end // seq_len)
                return grpo_loss(lp.view(-1, seq_len), inputs, r, den)[0], None

            bounds = list(range(0, n + 1, seq_len))
            out = fused_linear_loss(
                hidden_leaf, weight, inputs["targets"], group, segments=bounds, validate=False
            )
            out.loss.backward()

        def two_step(head, hidden_leaf=hidden_leaf, weight=weight):
            zero()
            lp, _ = head(hidden_leaf, weight, inputs["targets"], with_entropy=False)
            grpo_loss(lp, inputs, every, den)[0].backward()

        variants = {
            "fused": fused,
            "kernel+loss": lambda: two_step(fused_linear_logprob),
            "eager": lambda: two_step(reference_linear_logprob),
        }
        if liger is not None:
            variants["liger"] = lambda hl=hidden_leaf, wt=weight: liger(hl, wt, inputs)
        results["frozen" if frozen else "trainable"] = timed(variants, reps)
    return results


def _liger_loss():
    """Liger-Kernel's chunked GRPO loss (``LigerFusedLinearGRPOLoss``), or None when it does not
    import here (it needs triton, i.e. a GPU build)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as error:  # ImportError, or triton failing to find a GPU driver
        print(f"liger-kernel: not available on this machine ({type(error).__name__}: {error})")
        return None
    loss_fn = LigerFusedLinearGRPOLoss(beta=GRPO.kl_coef, use_ref_model=False)

    def run(hidden_leaf, weight, inputs):
        hidden_leaf.grad = None
        weight.grad = None
        loss, _ = loss_fn(
            hidden_leaf,
            weight,
            inputs["targets"],
            inputs["loss_mask"].long(),
            inputs["adv"][:, 0],
            ref_per_token_logps=inputs["ref"],
            old_per_token_logps=inputs["old"],
        )
        loss.backward()

    return run


def build_model(vocab: int, hidden: int, layers: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def bench_engine(rows: int, seq_len: int, vocab: int, hidden: int, layers: int, reps: int):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (rows,), generator=gen).tolist()
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    loss_mask = torch.zeros_like(mask)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
        loss_mask[b, n // 4 : n] = True
    group_adv = torch.randn(rows // 4, generator=gen).repeat_interleave(4)
    batch = TensorDict(
        input_ids=torch.randint(0, vocab, (rows, seq_len), generator=gen),
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=group_adv[:, None].expand(rows, seq_len).contiguous(),
        old_logprobs=-torch.rand(rows, seq_len, generator=gen) * 3 - 9,
        ref_logprobs=-torch.rand(rows, seq_len, generator=gen) * 3 - 9,
        batch_size=[rows],
    )
    engines = {}
    for fuse in (True, False):
        config = ActorConfig(
            micro_batch_size=4,
            lora=LoraConfig(rank=8, alpha=16),
            policy_loss=GRPO,
            fuse_loss=fuse,
        )
        engine = ActorEngine(build_model(vocab, hidden, layers), config)
        assert engine.fuses_loss(None) is fuse
        engines["fuse_loss=True" if fuse else "fuse_loss=False"] = engine
    return timed({name: (lambda e=e: e.train_batch(batch)) for name, e in engines.items()}, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--only", choices=["kernel", "engine"], help="run one part only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per variant")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = args.reps or (1 if args.quick else 3)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, reps={reps}\n")
    if args.only in (None, "kernel"):
        n, hidden, vocab = (512, 256, 8192) if args.quick else (2048, 512, 32768)
        print(f"1. GRPO loss on the lm head, N={n} H={hidden} V={vocab} fp32, fwd+bwd, best s")
        for head, t in bench_kernel(n, hidden, vocab, 256, reps).items():
            base = t["kernel+loss"]
            cells = " | ".join(f"{k} {v:.3f}s ({v / base:.2f}x)" for k, v in t.items())
            print(f"   {head:9s} head: {cells}   [ratios vs kernel+loss]")
            print(f"   {'':9s}       fused vs eager: {t['fused'] / t['eager']:.2f}x")
    if args.only in (None, "engine"):
        rows, seq_len, vocab, hidden, layers = (
            (8, 128, 8192, 256, 1) if args.quick else (16, 512, 32768, 512, 2)
        )
        print(
            f"\n2. GRPO LoRA train_batch: {rows} rows of {seq_len // 2}..{seq_len} tokens, "
            f"micro_batch_size 4, V={vocab} H={hidden}, {layers} layers, best s per step"
        )
        t = bench_engine(rows, seq_len, vocab, hidden, layers, reps)
        on, off = t["fuse_loss=True"], t["fuse_loss=False"]
        print(
            f"   fuse_loss=False {off:.3f}s | fuse_loss=True {on:.3f}s "
            f"({on / off:.2f}x, {100 * (1 - on / off):.0f}% faster)"
        )


if __name__ == "__main__":
    main()
