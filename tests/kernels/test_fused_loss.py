"""The fused policy-loss path (kernels/fused_loss.py; docs/kernels.md, docs/engine.md).

Kernel level: ``fused_linear_loss`` against the eager definition written here (full logits in
float64, autograd), for a per-sequence loss on log-probs and entropy, every head transform, a
frozen and a trainable weight, several groups and a segment longer than a group (the recompute
path), upstream gradients other than 1; detached outputs; bad input.

Engine level: ``fuse_loss=True`` against ``fuse_loss=False`` (today's kernel + loss path) on the
same float64 model and batch: loss, every metric and every parameter gradient, for each built-in
loss (PPO with dual clip, GRPO with KL, CISPO, an entropy bonus, GSPO with per-sequence
aggregation, the rollout-mismatch corrections, ``sft_loss``) under micro-batch splits, packing,
LoRA and gradient checkpointing. Both paths compute the same float64 log-probs (same kernel
tiles) and the same loss per row; only the summation order of the loss over row groups and of
BLAS blocking differs, so float64 gradients agree to ~1e-12 and the float32 metrics to float32
rounding (the tolerances below). Custom losses take the unfused path.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_close_dicts, grads_of, make_batch, tiny_model

from microrl.configs import ActorConfig, LoraConfig, PolicyLossConfig
from microrl.engine import ActorEngine, models
from microrl.kernels import fused_linear_loss

GRAD_RTOL, GRAD_ATOL = 1e-9, 1e-12  # float64 gradients: reassociation noise only
# The reported loss and the metrics are float32 (losses/metrics.py); sums over row groups differ
# from sums over the micro-batch by float32 rounding.
RTOL, ATOL = 2e-6, 1e-7


# ----------------------------------------------------------------------------- kernel level
def _eager(hidden, weight, targets, temperature, bias, scale, softcap):
    """The definition: full float64 logits, log_softmax, gather; entropy."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature.unsqueeze(-1), dim=-1)
    valid = targets != -100
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, ent, 0.0)


def _seq_loss(lp, ent, adv, seq):
    """A per-sequence loss: GSPO-like exp(mean log-prob of the sequence) times its advantage,
    plus a token-level entropy bonus; ``seq`` gives each row's sequence id."""
    sums = torch.zeros(int(seq.max()) + 1, dtype=lp.dtype).index_add(0, seq, lp)
    counts = torch.bincount(seq).to(lp.dtype)
    return -(adv * torch.exp(sums / counts / 4)).sum() - 0.05 * ent.sum()


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "trainable"])
@pytest.mark.parametrize("transforms", [False, True], ids=["plain", "bias-scale-softcap"])
@pytest.mark.parametrize("chunk_size", [None, 8], ids=["one-group", "groups+long-segment"])
def test_kernel_matches_float64_definition(frozen, transforms, chunk_size) -> None:
    torch.manual_seed(0)
    n, h_size, vocab = 60, 16, 300
    hidden = torch.randn(n, h_size, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(vocab, h_size, dtype=torch.float64) * 0.5).requires_grad_(not frozen)
    bias = (torch.randn(vocab, dtype=torch.float64) * 0.1).requires_grad_() if transforms else None
    scale, softcap = (0.7, 5.0) if transforms else (1.0, None)
    targets = torch.randint(0, vocab, (n,))
    targets[::7] = -100
    temperature = torch.rand(n, dtype=torch.float64) + 0.5
    # Segments: sequences of 5, 20 (longer than an 8-row group) and 35 rows.
    bounds = [0, 5, 25, 60]
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 20, 35]))
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    calls = []

    def group_loss(start, end, lp, ent):
        assert start in bounds and end in bounds  # a group never splits a segment
        calls.append((start, end))
        local = seq[start:end] - seq[start]
        return _seq_loss(lp, ent, adv[seq[start] : seq[end - 1] + 1], local), end - start

    out = fused_linear_loss(
        hidden, weight, targets, group_loss, segments=bounds, temperature=temperature,
        with_entropy=True, chunk_size=chunk_size, bias=bias, logit_scale=scale, softcap=softcap,
    )  # fmt: skip
    assert out.aux == [e - s for s, e in calls] and calls[0][0] == 0 and calls[-1][1] == n
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    (out.loss * 3.0).backward()  # an upstream gradient other than 1
    params = [p for p in (hidden, weight, bias) if p is not None and p.requires_grad]
    fused_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    lp, ent = _eager(hidden, weight, targets, temperature, bias, scale, softcap)
    expected = _seq_loss(lp, ent, adv, seq)
    (expected * 3.0).backward()
    torch.testing.assert_close(out.loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.logprobs, lp.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.entropy, ent.detach(), rtol=0, atol=1e-12)
    for got, p in zip(fused_grads, params, strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-10, atol=1e-12)
    assert weight.grad is None if frozen else weight.grad is not None
    assert (hidden.grad[targets == -100] == 0).all()  # ignored rows: exactly no gradient


def test_kernel_float32_and_bf16_inputs_match_float64_truth() -> None:
    torch.manual_seed(1)
    n, h_size, vocab = 40, 32, 1000
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(n, h_size).to(dtype).requires_grad_()
        weight = (torch.randn(vocab, h_size) * 0.3).to(dtype).requires_grad_()
        targets = torch.randint(0, vocab, (n,))
        adv = torch.randn(n)

        def token_loss(start, end, lp, _ent, adv=adv):
            return -(adv[start:end] * lp).sum() / n, None

        out = fused_linear_loss(hidden, weight, targets, token_loss, chunk_size=16)
        out.loss.backward()
        h64 = hidden.detach().double().requires_grad_()
        w64 = weight.detach().double().requires_grad_()
        ones = torch.ones(n, dtype=torch.float64)
        lp, _ = _eager(h64, w64, targets, ones, None, 1.0, None)
        (-(adv.double() * lp).sum() / n).backward()
        assert out.logprobs.dtype == torch.float32 and hidden.grad.dtype == dtype
        torch.testing.assert_close(out.logprobs.double(), lp.detach(), rtol=0, atol=1e-4)
        # Gradients: float32 math, rounded once to the input dtype.
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        for got, want in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
            scale = want.abs().max()
            worst = (got.double() - want).abs().max() / scale
            assert worst <= tol, f"{dtype}: worst relative error {worst:.2e}"


def test_kernel_bad_input_and_misuse() -> None:
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(10, 4)
    targets = torch.randint(0, 10, (6,))

    def ok(start, end, lp, ent):
        return lp.sum(), None

    with pytest.raises(ValueError, match="targets"):
        fused_linear_loss(hidden, weight, torch.full((6,), 10), ok)
    with pytest.raises(ValueError, match="segments"):
        fused_linear_loss(hidden, weight, targets, ok, segments=[0, 3, 5])
    with pytest.raises(ValueError, match="increasing"):
        fused_linear_loss(hidden, weight, targets, ok, segments=[0, 3, 3, 6])
    with pytest.raises(TypeError, match="callable"):
        fused_linear_loss(hidden, weight, targets, "loss")
    with pytest.raises(TypeError, match="0-d"):
        fused_linear_loss(hidden, weight, targets, lambda s, e, lp, ent: (lp, None))
    out = fused_linear_loss(hidden, weight, targets, ok)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        out.loss.backward()
    # A loss that does not depend on the log-probs: zero gradient, not garbage.
    hidden.grad = None
    const = fused_linear_loss(hidden, weight, targets, lambda s, e, lp, ent: (lp.sum() * 0, None))
    const.loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    with torch.no_grad():  # values only
        assert fused_linear_loss(hidden, weight, targets, ok).loss.requires_grad is False


# ----------------------------------------------------------------------------- engine level
LOSSES = {
    "ppo-dual-clip": dict(policy_loss=PolicyLossConfig(clip_ratio_c=2.0)),
    "grpo-kl": dict(policy_loss=PolicyLossConfig(name="grpo", kl_coef=0.1, kl_estimator="k3")),
    "cispo": dict(policy_loss=PolicyLossConfig(name="cispo", clip_ratio_high=0.1)),
    "entropy-bonus": dict(policy_loss=PolicyLossConfig(entropy_coef=0.05)),
    "gspo-seq-mean": dict(
        policy_loss=PolicyLossConfig(name="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05),
        loss_agg_mode="seq-mean-token-mean",
    ),
    "mismatch": dict(
        policy_loss=PolicyLossConfig(
            tis_cap=1.5, token_ratio_band=(0.5, 1.8), seq_ratio_band=(0.7, 1.4), kl_coef=0.05
        )
    ),
    "sft": dict(),
}


def _batch():
    batch = make_batch(6, 12, padding="mixed", seed=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    shape = batch["old_logprobs"].shape
    # Old log-probs near the model's own (~ -4.9 for V=128) so ratios straddle the clips.
    batch["old_logprobs"] = -4.85 + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    batch["ref_logprobs"] = batch["old_logprobs"] + 0.2 * torch.randn(
        shape, generator=gen, dtype=torch.float64
    )
    batch["rollout_logprobs"] = batch["old_logprobs"] + 0.4 * torch.randn(
        shape, generator=gen, dtype=torch.float64
    )
    return batch


def _run(name, fuse, *, lora=False, checkpointing=False, **split):
    config = ActorConfig(
        fuse_loss=fuse,
        lora=LoraConfig(rank=4, alpha=8) if lora else LoraConfig(),
        gradient_checkpointing=checkpointing,
        **LOSSES[name],
        **split,
    )
    engine = ActorEngine(tiny_model("qwen2", seed=2, dtype=torch.float64), config)
    loss_fn = engine.sft_loss if name == "sft" else None
    assert engine.fuses_loss(loss_fn) is fuse
    result = engine.forward_backward_batch(_batch(), loss_fn=loss_fn)
    return result, grads_of(engine.module)


def _assert_same(fused, plain):
    (res_f, grads_f), (res_p, grads_p) = fused, plain
    assert abs(res_f["loss"] - res_p["loss"]) <= ATOL + RTOL * abs(res_p["loss"])
    assert_close_dicts(res_f["metrics"], res_p["metrics"], rtol=RTOL, atol=ATOL)
    assert_close_dicts(grads_f, grads_p, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    for key, value in res_p["model_output"].items():
        got = res_f["model_output"][key]
        assert not got.requires_grad
        torch.testing.assert_close(got, value, rtol=0, atol=1e-12)
    assert set(res_f["model_output"].keys()) == set(res_p["model_output"].keys())


# (micro_batch_size, max_tokens, packed, kernel_chunk_size): one micro-batch and one row group;
# two rows per micro-batch in groups of at most 8 tokens (each 12-token row a group of its own,
# in chunks, with recomputed tiles); packed under a token budget.
SPLITS = {
    "one-micro-batch": dict(micro_batch_size=6),
    "mbs2-chunk8": dict(micro_batch_size=2, kernel_chunk_size=8),
    "packed-budget": dict(max_tokens_per_micro_batch=17, pack_sequences=True),
}


# Every loss under a split that groups rows differently from the unfused micro-batch, the
# per-sequence ones (GSPO, sequence masking) and sft under all of them.
CASES = [
    ("ppo-dual-clip", "one-micro-batch"),
    ("grpo-kl", "mbs2-chunk8"),
    ("grpo-kl", "packed-budget"),
    ("cispo", "packed-budget"),
    ("entropy-bonus", "mbs2-chunk8"),
    ("gspo-seq-mean", "one-micro-batch"),
    ("gspo-seq-mean", "mbs2-chunk8"),
    ("gspo-seq-mean", "packed-budget"),
    ("mismatch", "mbs2-chunk8"),
    ("mismatch", "packed-budget"),
    ("sft", "one-micro-batch"),
    ("sft", "mbs2-chunk8"),
]


@pytest.mark.parametrize(("name", "split"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_engine_fused_equals_unfused(name, split) -> None:
    _assert_same(_run(name, True, **SPLITS[split]), _run(name, False, **SPLITS[split]))


@pytest.mark.usefixtures("intra_op_threads")
@pytest.mark.parametrize("name", ["gspo-seq-mean", "sft"])
def test_engine_fused_equals_unfused_lora_checkpointing_packed(name) -> None:
    split = dict(micro_batch_size=4, pack_sequences=True, kernel_chunk_size=16)
    fused = _run(name, True, lora=True, checkpointing=True, **split)
    _assert_same(fused, _run(name, False, lora=True, checkpointing=True, **split))
    assert fused[1] and all("lora" in key for key in fused[1])  # only adapters train
    assert any(g.abs().max() > 0 for g in fused[1].values())


def test_engine_uses_the_fused_path_only_where_it_applies(monkeypatch) -> None:
    calls = []
    real = models.fused_linear_loss
    monkeypatch.setattr(
        models, "fused_linear_loss", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    engine = ActorEngine(tiny_model(seed=2), ActorConfig(micro_batch_size=3))
    batch = make_batch(6, 12, seed=3)

    def custom(output, micro, denominators):
        return engine.default_loss(output, micro, denominators)

    assert engine.fuses_loss(None) and engine.fuses_loss(engine.sft_loss)
    assert not engine.fuses_loss(custom) and not engine.fuses_loss(None, training=False)
    engine.forward_backward_batch(batch)
    assert len(calls) == 2  # one per micro-batch
    fused_grads = grads_of(engine.module)
    engine.module.zero_grad(set_to_none=True)
    engine.forward_backward_batch(batch, loss_fn=custom)  # the same loss, custom: unfused
    engine.infer_batch(batch)  # forward-only: never fused
    assert len(calls) == 2
    assert_close_dicts(grads_of(engine.module), fused_grads, rtol=1e-5, atol=1e-7)

    class Overridden(ActorEngine):
        def default_loss(self, output, micro_batch, denominators):
            return super().default_loss(output, micro_batch, denominators)

    assert not Overridden(tiny_model(seed=2), ActorConfig()).fuses_loss(None)
    assert not ActorEngine(tiny_model(seed=2), ActorConfig(fuse_loss=False)).fuses_loss(None)
    eager = ActorEngine(tiny_model(seed=2), ActorConfig(use_fused_kernel=False))
    assert not eager.fuses_loss(None)


def test_engine_fused_train_batch_steps_like_unfused() -> None:
    """Two optimizer steps (AdamW) on each path: same parameters after, and a loss that moves."""
    batch = _batch()
    states = []
    for fuse in (True, False):
        config = ActorConfig(micro_batch_size=2, fuse_loss=fuse, **LOSSES["grpo-kl"])
        engine = ActorEngine(tiny_model("qwen2", seed=2, dtype=torch.float64), config)
        first = engine.train_batch(batch)
        second = engine.train_batch(batch)
        assert first["step_skipped"] == 0.0 and second["loss"] != first["loss"]
        states.append({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    assert_close_dicts(states[0], states[1], rtol=1e-9, atol=1e-12)
