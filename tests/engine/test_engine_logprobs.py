"""Token-aligned log-probs / values of the engine against a row-by-row reference."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_utils import HIDDEN, VOCAB, make_batch, reference_logprobs, repad, tiny_model
from torch import nn

from microrl.configs import ActorConfig, CriticConfig
from microrl.engine import ActorEngine, CriticEngine
from microrl.engine.models import decoder_body

ATOL = 2e-5  # fp32 model, fp64 reference: rounding of a 2-layer hidden-32 model


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("padding", ["left", "right", "mixed"])
def test_infer_logprobs_match_reference(fused: bool, packed: bool, padding: str) -> None:
    model = tiny_model("qwen2")
    config = ActorConfig(
        micro_batch_size=4, use_fused_kernel=fused, pack_sequences=packed, temperature=0.7
    )
    engine = ActorEngine(model, config)
    assert engine.uses_fused_kernel is fused
    batch = make_batch(7, 12, padding=padding, seed=1)
    out = engine.infer_batch(batch)
    expected_lp, expected_ent = reference_logprobs(model, batch, temperature=0.7)
    assert out["logprobs"].dtype == torch.float32 and out["logprobs"].grad_fn is None
    torch.testing.assert_close(out["logprobs"].double(), expected_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), expected_ent, atol=ATOL, rtol=0)
    # No prediction (padding, first real token) holds exactly 0.
    mask = batch["attention_mask"]
    first = torch.zeros_like(mask)
    first[:, 1:] = mask[:, 1:] & ~mask[:, :-1]
    first[:, 0] = mask[:, 0]
    assert (out["logprobs"][~mask | first] == 0).all()


def test_left_right_mixed_padding_give_identical_logprobs() -> None:
    engine = ActorEngine(tiny_model("llama"), ActorConfig(micro_batch_size=3))
    base = make_batch(6, 10, padding="right", seed=2)
    results = {}
    for padding in ("left", "right", "both"):
        batch = repad(base, padding)
        out = engine.infer_batch(batch)
        # Compare on the real span of each row, moved back to a common (right) layout.
        results[padding] = repad(out.set("attention_mask", batch["attention_mask"]), "right")
    for padding in ("left", "both"):
        # Rows are compacted before the model runs, so the computation is the same; a tolerance
        # anyway, as BLAS promises no bitwise reproducibility between calls.
        torch.testing.assert_close(
            results[padding]["logprobs"], results["right"]["logprobs"], rtol=0, atol=1e-6
        )


def test_packed_equals_padded_including_gradients() -> None:
    batch = make_batch(5, 14, padding="mixed", seed=3)
    results = []
    for packed in (False, True):
        engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=5, pack_sequences=packed))
        batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
        result = engine.forward_backward_batch(batch)
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
        results.append((result, grads))
    (padded, g_padded), (packed, g_packed) = results
    torch.testing.assert_close(
        packed["model_output"]["logprobs"], padded["model_output"]["logprobs"], atol=1e-5, rtol=0
    )
    assert abs(packed["loss"] - padded["loss"]) < 1e-6
    for name in g_padded:
        torch.testing.assert_close(g_packed[name], g_padded[name], atol=1e-5, rtol=1e-4)


def test_lm_head_with_bias_takes_the_fused_path(caplog) -> None:
    """The kernel adds the bias (test_engine_heads.py: every family with a head transform)."""
    model = tiny_model("qwen2")
    head = nn.Linear(HIDDEN, VOCAB, bias=True)
    nn.init.normal_(head.bias, std=1.0)
    model.lm_head = head
    with caplog.at_level(logging.WARNING):
        engine = ActorEngine(model, ActorConfig(micro_batch_size=2))
    assert engine.uses_fused_kernel
    assert "not plain" not in caplog.text
    batch = make_batch(4, 9, seed=4)
    expected, _ = reference_logprobs(model, batch)
    torch.testing.assert_close(
        engine.infer_batch(batch)["logprobs"].double(), expected, atol=ATOL, rtol=0
    )


def test_logit_softcapping_config_takes_the_fused_path() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        final_logit_softcapping=0.5,  # strong capping: a fused path without it would be wrong
        attn_implementation="eager",
    )
    model = Gemma2ForCausalLM(config)
    engine = ActorEngine(model, ActorConfig(micro_batch_size=3))
    assert engine.uses_fused_kernel
    batch = make_batch(4, 9, seed=5)
    expected, _ = reference_logprobs(model, batch)
    torch.testing.assert_close(
        engine.infer_batch(batch)["logprobs"].double(), expected, atol=ATOL, rtol=0
    )


def test_numerical_probe_catches_an_unknown_logit_transform() -> None:
    """A model whose forward rescales the logits without any config attribute saying so."""
    from transformers import Qwen2ForCausalLM

    class ScaledLogits(Qwen2ForCausalLM):  # a test-only subclass, no transformers class patched
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    base = tiny_model("qwen2")
    model = ScaledLogits(base.config)
    model.load_state_dict(base.state_dict())
    engine = ActorEngine(model, ActorConfig(micro_batch_size=3))
    assert not engine.uses_fused_kernel
    batch = make_batch(3, 8, seed=6)
    expected, _ = reference_logprobs(model, batch)
    torch.testing.assert_close(
        engine.infer_batch(batch)["logprobs"].double(), expected, atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_critic_values_are_token_aligned(packed: bool) -> None:
    model = tiny_model("qwen2")
    engine = CriticEngine(model, CriticConfig(micro_batch_size=2, pack_sequences=packed))
    batch = make_batch(5, 11, padding="mixed", seed=7)
    values = engine.infer_batch(batch)["values"]
    head = engine.module.value_head
    body = decoder_body(model)
    mask = batch["attention_mask"]
    expected = torch.zeros(values.shape)
    with torch.no_grad():
        for b in range(mask.shape[0]):
            cols = mask[b].nonzero().squeeze(1)
            hidden = body(input_ids=batch["input_ids"][b, cols][None]).last_hidden_state[0]
            expected[b, cols[1:]] = head(hidden).squeeze(-1)[:-1]
    torch.testing.assert_close(values, expected, atol=ATOL, rtol=0)


def test_model_from_local_checkpoint_path(tmp_path) -> None:
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    engine = ActorEngine(str(tmp_path / "ckpt"), ActorConfig(micro_batch_size=2))
    batch = make_batch(3, 8, seed=8)
    expected, _ = reference_logprobs(model, batch)
    torch.testing.assert_close(
        engine.infer_batch(batch)["logprobs"].double(), expected, atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sliding_window_and_eager_attention(attn: str, packed: bool) -> None:
    """Packed rows keep each layer's own mask: causal, and the sliding window where it applies."""
    model = tiny_model(
        "qwen2",
        use_sliding_window=True,
        sliding_window=4,  # shorter than most rows, so the window matters
        max_window_layers=1,  # layer 0 full attention, layer 1 sliding
        attn_implementation=attn,
    )
    engine = ActorEngine(model, ActorConfig(micro_batch_size=3, pack_sequences=packed))
    batch = make_batch(5, 12, padding="mixed", seed=9)
    expected, _ = reference_logprobs(model, batch)
    out = engine.infer_batch(batch)["logprobs"]
    torch.testing.assert_close(out.double(), expected, atol=ATOL, rtol=0)


def test_bf16_autocast_outputs_are_fp32_and_close() -> None:
    model = tiny_model("qwen2")
    batch = make_batch(4, 10, seed=10)
    expected, _ = reference_logprobs(model, batch)
    engine = ActorEngine(model, ActorConfig(micro_batch_size=2, dtype="bfloat16"))
    out = engine.infer_batch(batch)
    assert out["logprobs"].dtype == torch.float32 and out["entropy"].dtype == torch.float32
    torch.testing.assert_close(out["logprobs"].double(), expected, atol=2e-2, rtol=0)
    batch["old_logprobs"] = out["logprobs"]
    metrics = engine.forward_backward_batch(batch)["metrics"]
    # The same computation again: ratio 1 up to GEMM rounding of the fp32 head (see test_engine_train).
    assert abs(metrics["ratio_min"] - 1) <= 1e-5 and abs(metrics["ratio_max"] - 1) <= 1e-5
    assert all(p.grad.dtype == torch.float32 for p in engine.module.parameters())


def test_generation_with_the_engine_model_is_unchanged_by_packing() -> None:
    """The varlen attention installed for packing is exactly the model's own without packed rows."""
    reference = tiny_model("qwen2")
    engine = ActorEngine(tiny_model("qwen2"), ActorConfig(micro_batch_size=2, pack_sequences=True))
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding, as for generation
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    expected = reference.generate(input_ids=ids, attention_mask=mask, **kwargs)
    generated = engine.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert torch.equal(generated, expected)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("kind", ["per-row", "per-token"])
def test_batch_temperature_overrides_the_config(fused: bool, packed: bool, kind: str) -> None:
    model = tiny_model("qwen2")
    config = ActorConfig(micro_batch_size=2, use_fused_kernel=fused, pack_sequences=packed)
    engine = ActorEngine(model, config)
    batch = make_batch(5, 10, padding="mixed", seed=12)
    gen = torch.Generator().manual_seed(0)
    shape = (5,) if kind == "per-row" else (5, 10)
    batch["temperature"] = 0.5 + torch.rand(shape, generator=gen)
    expected, expected_entropy = reference_logprobs(model, batch, batch["temperature"])
    out = engine.infer_batch(batch)
    torch.testing.assert_close(out["logprobs"].double(), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), expected_entropy, atol=ATOL, rtol=0)


def test_bad_temperature_is_rejected() -> None:
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2))
    batch = make_batch(3, 8, seed=13)
    with pytest.raises(ValueError, match="temperature"):
        engine.infer_batch(batch.set("temperature", torch.zeros(3)))
    with pytest.raises(ValueError, match="temperature"):
        engine.infer_batch(batch.set("temperature", torch.ones(3, 2)))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gradient_equals_a_hand_written_loop(fused: bool, packed: bool) -> None:
    """End to end against plain autograd (fp64): per row, ``model(ids).logits / T`` ->
    ``log_softmax`` -> the next token's log-prob, REINFORCE ``-A * logp`` summed over the loss
    tokens / N_tokens. Equal loss and gradients prove the engine's alignment, masking, head path
    and normalisation, not just its agreement with itself."""
    from microrl.configs import PolicyLossConfig

    temperature = 0.8
    state = tiny_model("qwen2", dtype=torch.float64).state_dict()
    batch = make_batch(5, 12, padding="mixed", seed=5, dtype=torch.float64)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    loss_mask, advantages = batch["loss_mask"], batch["advantages"]

    reference = tiny_model("qwen2", dtype=torch.float64)
    reference.load_state_dict(state)
    expected_loss = torch.zeros((), dtype=torch.float64)
    for b in range(ids.shape[0]):
        cols = mask[b].nonzero().squeeze(1)
        logits = reference(input_ids=ids[b, cols].unsqueeze(0), use_cache=False).logits[0]
        logp = torch.log_softmax(logits / temperature, dim=-1)
        for j in range(len(cols) - 1):  # position cols[j] predicts token cols[j + 1]
            t = cols[j + 1]
            if loss_mask[b, t]:
                expected_loss = expected_loss - advantages[b, t] * logp[j, ids[b, t]]
    expected_loss = expected_loss / loss_mask.sum()
    expected_loss.backward()

    model = tiny_model("qwen2", dtype=torch.float64)
    model.load_state_dict(state)
    config = ActorConfig(
        micro_batch_size=2,
        use_fused_kernel=fused,
        pack_sequences=packed,
        temperature=temperature,
        loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(name="reinforce"),
    )
    engine = ActorEngine(model, config)
    result = engine.forward_backward_batch(batch)
    assert result["loss"] == pytest.approx(expected_loss.item(), rel=1e-6)  # float32 metric
    body = engine.module.causal_lm
    for (name, p), (ref_name, ref_p) in zip(
        body.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert name == ref_name and p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_bf16_autocast_head_is_fp32_accurate(fused: bool) -> None:
    """Under bf16 autocast the body runs its matmuls in bf16, but the head never rounds logits
    to 16 bits (autocast would run ``lm_head`` in bf16): log-probs equal
    ``log_softmax(h.double() @ W.double().T / T)`` of the body's own ``h`` to fp32 rounding (a bf16 head is off by ~2^-8 of the logits, ~1e-2 here), on the fused
    and the eager path alike, so ``use_fused_kernel`` changes nothing beyond fp32 rounding."""
    temperature = 0.7
    model = tiny_model("qwen2")
    batch = make_batch(4, 10, padding="none", seed=17)
    config = ActorConfig(
        micro_batch_size=4, dtype="bfloat16", use_fused_kernel=fused, temperature=temperature
    )
    engine = ActorEngine(model, config)
    assert engine.uses_fused_kernel is fused
    out = engine.infer_batch(batch)["logprobs"]
    ids = batch["input_ids"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = decoder_body(model)(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(ids.shape[1]).expand_as(ids),
            use_cache=False,
        ).last_hidden_state
    logits = hidden.double() @ model.lm_head.weight.double().T / temperature
    expected = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    # fp32 head of bf16 inputs: 32-term fp32 dot products and an fp32 log-softmax, ~1e-6.
    torch.testing.assert_close(out[:, 1:].double(), expected, rtol=0, atol=1e-5)


def test_fused_and_eager_agree_under_bf16_autocast_with_gradients() -> None:
    """Switching ``use_fused_kernel`` under autocast changes loss and gradients by fp32 rounding
    of the head only (the body runs the same bf16 computation on both paths)."""
    batch = make_batch(5, 12, padding="mixed", seed=18)
    results = []
    for fused in (True, False):
        config = ActorConfig(micro_batch_size=2, dtype="bfloat16", use_fused_kernel=fused)
        engine = ActorEngine(tiny_model("qwen2", seed=4), config)
        result = engine.forward_backward_batch(batch)
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
        results.append((result, grads))
    (fused_r, fused_g), (eager_r, eager_g) = results
    torch.testing.assert_close(
        fused_r["model_output"]["logprobs"], eager_r["model_output"]["logprobs"], rtol=0, atol=1e-5
    )
    assert fused_r["loss"] == pytest.approx(eager_r["loss"], rel=1e-5, abs=1e-6)
    for name, grad in eager_g.items():
        # The head's gradient is fp32 on both paths; the body's backward runs in bf16 (autocast)
        # from head gradients that differ by fp32 rounding, which bf16 rounding may amplify to
        # one bf16 ulp of the activations' gradients: 2^-8 relative.
        torch.testing.assert_close(fused_g[name], grad, rtol=1e-2, atol=1e-4, msg=name)
