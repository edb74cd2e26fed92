"""A frozen base stored in 16 bits under LoRA (``EngineConfig.base_dtype``).

What must hold: the frozen base parameters are 16-bit and everything that trains (adapters, a
critic's value head, their gradients and AdamW state) is float32; the head stays the fp32 head
(logits never rounded to 16 bits); a checkpoint resumes exactly; ``disable_adapter()`` runs the
16-bit base; and training follows the fp32-base run within a bf16 tolerance derived below.

Two kinds of comparison:

* **Tight (fp32 rounding):** the engine against a hand-written pass over *the same* 16-bit model
  (its decoder body, then the eager fp32 head ``reference_linear_logprob``). Same operations in
  the same shapes, so log-probs and gradients agree to fp32 rounding: that proves the engine's
  path (16-bit body, fp32 head from a 16-bit weight, fp32 adapters) adds no error of its own.
  An fp32 base holding the bf16-rounded weights is *not* such a reference: with a 16-bit base the
  activations are 16-bit too (embedding output, residual stream, norms), with an fp32 base they
  stay fp32, so those two runs differ by the activations' rounding, not by fp32 rounding.
* **Against the fp32 base (bf16 tolerance):** bf16 keeps 8 significant bits, so one rounding
  has relative error at most ``U = 2**-8``. Every logit is a sum of products of rounded weights
  and rounded activations, each rounding independent: the logit's error is a few ``U`` times
  the logit scale, and ``log_softmax`` at most doubles it (``|d logp| <= 2 max |d z|``). So
  ``|d logp| <= 8 U max|z|`` leaves a margin of about 8 over the ~``U max|z|`` measured. The
  gradients get the same relative error (measured 1-2 ``U`` after three steps), and an SGD
  update is linear in them, so the adapters' updates agree to ``8 U`` relatively. (AdamW's first
  step is ``lr * sign(g)``: an entry whose gradient is within rounding noise of zero flips by
  ``2 lr`` whatever the precision, so the trajectory test uses SGD and the PPO surrogate without
  clipping; the AdamW state is checked for dtype and exact resume.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_utils import grads_of, make_batch, tiny_model

from microrl.configs import (
    ActorConfig,
    CriticConfig,
    EngineConfig,
    LoraConfig,
    OptimConfig,
    PolicyLossConfig,
)
from microrl.engine import ActorEngine, CriticEngine
from microrl.engine.models import decoder_body
from microrl.engine.setup import autocast_context
from microrl.kernels import reference_linear_logprob

U = 2.0**-8  # bf16's unit roundoff: 8 significant bits, round to nearest
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
LORA = LoraConfig(rank=4, alpha=8.0)


def _model(seed: int = 3) -> torch.nn.Module:
    """The tiny Qwen2 with its lm head scaled so the logits spread over about +-4, as a trained
    model's do (the random init's are within +-0.5, which would hide a head's rounding)."""
    model = tiny_model("qwen2", seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def _config(base_dtype: str = "bfloat16", **overrides) -> ActorConfig:
    overrides.setdefault("micro_batch_size", 3)
    overrides.setdefault("lora", LORA)
    return ActorConfig(base_dtype=base_dtype, **overrides)


def _frozen_and_trainable(module: torch.nn.Module):
    params = list(module.parameters())
    return [p for p in params if not p.requires_grad], [p for p in params if p.requires_grad]


def _randomise_lora_b(engine, seed: int = 1) -> None:
    """peft starts B at zero (A then gets no gradient); give it values so both are tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


# ------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("base_dtype", ["bfloat16", "float16"])
def test_16_bit_base_without_lora_is_refused_by_name(base_dtype: str) -> None:
    with pytest.raises(ValueError, match=r"base_dtype.*lora\.rank"):
        EngineConfig(base_dtype=base_dtype)
    with pytest.raises(ValueError, match="base_dtype"):
        ActorConfig(base_dtype="fp8", lora=LORA)
    assert ActorConfig(base_dtype=base_dtype, lora=LORA).base_dtype == base_dtype


# ------------------------------------------------------------------------------ what is stored how
@pytest.mark.parametrize("base_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("source", ["object", "path"])
def test_frozen_base_is_16_bit_and_everything_trained_is_fp32(tmp_path, source, base_dtype):
    model = _model()
    if source == "path":
        model.save_pretrained(tmp_path / "base")
        model = tmp_path / "base"
    engine = ActorEngine(model, _config(base_dtype, optim=OptimConfig(lr=1e-2)))
    frozen, trainable = _frozen_and_trainable(engine.module)
    assert frozen and all(p.dtype == DTYPES[base_dtype] for p in frozen)
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    named = dict(engine.module.named_parameters())
    assert all("lora_" in n for n, p in named.items() if p.requires_grad)
    # Buffers keep their dtype: rotary frequencies are not rounded to 16 bits.
    assert all(b.dtype == torch.float32 for b in engine.module.buffers())

    # Half the bytes of the frozen base of an fp32-base engine; the adapters' bytes unchanged.
    reference = ActorEngine(_model(), _config("float32"))
    ref_frozen, ref_trainable = _frozen_and_trainable(reference.module)
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    assert nbytes(frozen) * 2 == nbytes(ref_frozen)
    assert nbytes(trainable) == nbytes(ref_trainable)

    batch = make_batch(6, 12, seed=0)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    for _ in range(2):
        metrics = engine.train_batch(batch)
        assert metrics["step_skipped"] == 0.0 and torch.isfinite(torch.tensor(metrics["loss"]))
    engine.forward_backward_batch(batch)  # gradients left in place to inspect
    assert all(p.grad is None for p in frozen)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)
    state = engine.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)
    for entry in state.values():
        assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.float32
    out = engine.infer_batch(batch)
    assert out["logprobs"].dtype == out["entropy"].dtype == torch.float32


def test_critic_value_head_and_adapters_stay_fp32_over_a_16_bit_base() -> None:
    config = CriticConfig(micro_batch_size=3, base_dtype="bfloat16", lora=LORA)
    engine = CriticEngine(_model(), config)
    frozen, trainable = _frozen_and_trainable(engine.module)
    assert all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in trainable)
    head = engine.module.value_head
    assert head.weight.requires_grad and head.weight.dtype == head.bias.dtype == torch.float32
    batch = make_batch(6, 12, seed=1)
    engine.train_batch(batch)
    assert engine.infer_batch(batch)["values"].dtype == torch.float32
    assert all(s["exp_avg"].dtype == torch.float32 for s in engine.optimizer.state.values())


# ------------------------------------------------------------------------------ tight: same model
def _hand_pass(engine, batch, loss_mask=None):
    """The decoder body of the engine's own model (16-bit), then the eager fp32 head, on the
    unpadded ``[B, T]`` batch as one block (the shape the engine runs it in): predicting-position
    log-probs ``[B, T - 1]`` and, with ``loss_mask``, the SFT loss (token mean)."""
    ids = batch["input_ids"]
    rows, width = ids.shape
    with autocast_context(engine.config, engine.device):
        hidden = decoder_body(engine.model)(
            input_ids=ids,
            position_ids=torch.arange(width).expand(rows, width),
            attention_mask=torch.ones(rows, width, dtype=torch.long),
            use_cache=False,
        ).last_hidden_state
    targets = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)
    head = engine.model.get_output_embeddings().weight
    logprobs = reference_linear_logprob(hidden, head, targets, with_entropy=False)[0][:, :-1]
    if loss_mask is None:
        return logprobs, hidden
    mask = loss_mask[:, 1:].float()
    return logprobs, -(logprobs * mask).sum() / mask.sum()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["no-autocast", "autocast"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_log_probs_are_the_fp32_head_of_the_16_bit_body(dtype: str, fused: bool) -> None:
    engine = ActorEngine(_model(), _config(dtype=dtype, use_fused_kernel=fused, micro_batch_size=6))
    # The 16-bit head passes the plain-head probe: the kernel path, not the model's own head.
    assert engine.uses_fused_kernel is fused and engine.module.plain_head
    _randomise_lora_b(engine)
    batch = make_batch(6, 16, padding="none", seed=2)
    with torch.no_grad():
        expected, hidden = _hand_pass(engine, batch)
        # What a head run in 16 bits would give: logits rounded to bf16.
        rounded = torch.log_softmax(engine.model(input_ids=batch["input_ids"]).logits.float(), -1)
    assert hidden.dtype == torch.bfloat16  # the body runs in the base's dtype
    got = engine.infer_batch(batch)["logprobs"][:, 1:]
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    rounded = rounded[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    assert (rounded - expected).abs().max() > 1e-3  # the check above could tell them apart


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["no-autocast", "autocast"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_gradients_equal_a_hand_pass_over_the_same_16_bit_model(dtype: str, fused: bool) -> None:
    engine = ActorEngine(_model(), _config(dtype=dtype, use_fused_kernel=fused, micro_batch_size=6))
    _randomise_lora_b(engine)
    batch = make_batch(6, 16, padding="none", seed=3)
    result = engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)
    got = grads_of(engine.module)
    engine.optimizer.zero_grad(set_to_none=True)
    _, loss = _hand_pass(engine, batch, batch["loss_mask"])
    loss.backward()
    expected = grads_of(engine.module)
    assert result["loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-6)
    assert expected.keys() == got.keys() and all(g.abs().max() > 0 for g in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------ against fp32
def _train(model, config, batch, steps: int, adapters=None):
    """``steps`` steps on ``batch`` (on-policy old log-probs): initial and final log-probs, the
    per-step losses, each adapter's update and its starting value."""
    engine = ActorEngine(copy.deepcopy(model), config)
    if adapters is not None:
        with torch.no_grad():
            for name, p in engine.module.named_parameters():
                if p.requires_grad:
                    p.copy_(adapters[name])
    start = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    batch = batch.clone()
    initial = batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    losses = [engine.train_batch(batch)["loss"] for _ in range(steps)]
    final = engine.infer_batch(batch)["logprobs"]
    updates = {
        n: p.detach() - start[n] for n, p in engine.module.named_parameters() if p.requires_grad
    }
    return initial, final, torch.tensor(losses), updates, start


def _relative_update_error(updates: dict, reference: dict) -> float:
    num = sum(((updates[n] - reference[n]) ** 2).sum() for n in reference)
    return float((num / sum((r**2).sum() for r in reference.values())).sqrt())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"], ids=["no-autocast", "autocast"])
def test_training_follows_the_fp32_base_within_bf16_tolerance(dtype: str) -> None:
    model, steps = _model(), 3
    batch = make_batch(6, 16, seed=4)
    # Steps that move the policy (by ~0.9 nats here) without the run amplifying small
    # differences (at lr 0.1 it moves by 4 nats and the gap grows to ~4 U max|z|), and the PPO
    # loss without its clipping: a ratio clipped in one run and not in the other switches that
    # token's gradient on or off, a jump no precision bounds.
    optim = OptimConfig(name="sgd", lr=0.02, grad_clip=None)
    smooth = PolicyLossConfig(clip_ratio_low=0.99, clip_ratio_high=100.0, clip_ratio_c=None)
    kwargs = {"dtype": dtype, "optim": optim, "policy_loss": smooth}
    half = _train(model, _config("bfloat16", **kwargs), batch, steps)
    # The same (16-bit-rounded) adapter initialisation, so only the base's dtype differs.
    full = _train(model, _config("float32", **kwargs), batch, steps, half[4])
    with torch.no_grad():
        max_logit = model(input_ids=batch["input_ids"]).logits.abs().max().item()
    tol = 8 * U * max_logit
    for got, want in ((half[0], full[0]), (half[1], full[1])):
        worst = (got - want).abs().max().item()
        assert worst <= tol, f"log-probs differ by {worst:.3g} > {tol:.3g}"
        assert worst > 0  # the two runs really used different weights
    error = _relative_update_error(half[3], full[3])
    assert error <= 8 * U, f"adapter updates differ by {error:.3g} relatively (> 8 U)"
    assert (full[1] - full[0]).abs().max() > 4 * tol  # training moved the policy well beyond it


# ------------------------------------------------------------------------------ checkpoints
def _snapshot(engine) -> dict:
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    optim = {
        f"{i}.{k}": v.clone()
        for i, entry in engine.optimizer.state_dict()["state"].items()
        for k, v in entry.items()
    }
    return {"params": params, "optim": optim, "step": engine.global_step}


def test_checkpoint_resume_is_exact_with_a_16_bit_base(tmp_path) -> None:
    _model().save_pretrained(tmp_path / "base")
    config = _config(optim=OptimConfig(lr=1e-2, weight_decay=0.01))
    batches = [make_batch(6, 12, seed=s) for s in range(5)]
    run = ActorEngine(tmp_path / "base", config)
    for b in batches[:2]:
        run.train_batch(b)
    run.save_checkpoint(tmp_path / "ckpt")
    for b in batches[2:]:
        run.train_batch(b)
    expected = _snapshot(run)

    torch.manual_seed(1234)  # another LoRA initialisation before the load
    resumed = ActorEngine(tmp_path / "base", config)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.global_step == 2
    for b in batches[2:]:
        resumed.train_batch(b)
    got = _snapshot(resumed)
    assert got["step"] == expected["step"]
    assert got["params"].keys() == expected["params"].keys()
    for name, value in expected["params"].items():
        assert got["params"][name].dtype == value.dtype, name
        assert torch.equal(got["params"][name], value), f"parameter {name} differs"
    assert got["optim"].keys() == expected["optim"].keys()
    for name, value in expected["optim"].items():
        assert value.dtype == torch.float32 and torch.equal(got["optim"][name], value), name


# ------------------------------------------------------------------------------ reference policy
def test_disable_adapter_runs_the_16_bit_base() -> None:
    engine = ActorEngine(_model(), _config(optim=OptimConfig(lr=1e-2)))
    batch = make_batch(6, 12, seed=5)
    before = engine.infer_batch(batch)["logprobs"]  # lora_B = 0: the policy is the base
    batch["old_logprobs"] = before
    for _ in range(3):
        engine.train_batch(batch)
    trained = engine.infer_batch(batch)["logprobs"]
    with engine.disable_adapter():
        reference = engine.infer_batch(batch)["logprobs"]
    assert not torch.equal(trained, before)
    assert torch.equal(reference, before)
    assert torch.equal(engine.infer_batch(batch)["logprobs"], trained)  # re-enabled after


def test_merged_export_is_written_in_the_base_dtype(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from microrl.engine.checkpoint.export import export_merged_model

    engine = ActorEngine(_model(), _config(optim=OptimConfig(lr=1e-2)))
    batch = make_batch(6, 12, seed=6)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    engine.train_batch(batch)
    path = export_merged_model(engine.module, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    # The merged bf16 weights are the adapted ones rounded once: the log-probs agree to bf16.
    with torch.no_grad():
        ids = batch["input_ids"][:1, :8]
        logits = engine.model(input_ids=ids).logits.float()
        got = merged(input_ids=ids).logits.float().log_softmax(-1)
    worst = (got - logits.log_softmax(-1)).abs().max()
    assert 0 < worst <= 8 * U * logits.abs().max()


def test_tied_embeddings_stay_tied_in_16_bits() -> None:
    model = tiny_model("qwen2", seed=3, tie_word_embeddings=True)
    engine = ActorEngine(model, _config(optim=OptimConfig(lr=1e-2)))
    head, embedding = engine.model.get_output_embeddings(), engine.model.get_input_embeddings()
    assert head.weight is embedding.weight and head.weight.dtype == torch.bfloat16
    assert engine.uses_fused_kernel
    batch = make_batch(6, 12, seed=7)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    assert engine.train_batch(batch)["step_skipped"] == 0.0
