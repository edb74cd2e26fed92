"""Every popular lm head on the fused path: lm-head bias (Phi), final-logit soft-capping (Gemma 2/3),
logit scaling (Cohere ``logit_scale``, Granite ``logits_scaling``).

Each family is built from its transformers config (tiny, random, no download) with a transform
strong enough to matter (soft-capping near the logits' size, a scale of 4, a unit-variance bias);
the engine must take the fused path and its log-probs must equal the model's own
``log_softmax(logits / T)``, with gradients equal to those through the model's own forward.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import HIDDEN, VOCAB, make_batch, reference_logprobs, tiny_model

from microrl.configs import ActorConfig
from microrl.engine import ActorEngine
from microrl.engine.models import LogitTransform, PolicyModel, fused_head_blocker, logit_transform

ATOL = 2e-5  # fp32 model, fp64 reference: rounding of a 2-layer hidden-32 model
COMMON = dict(
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)
# The raw logits of these tiny models are ~0.4 at most: a cap of 0.25 saturates tanh on many of
# them (slope 1 - tanh**2 from 1 down to ~0.4), so a missing or misplaced cap is visible.
FAMILIES = {
    "phi": ("PhiConfig", "PhiForCausalLM", {}, LogitTransform()),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=8, final_logit_softcapping=0.25, attn_implementation="eager"),
        LogitTransform(softcap=0.25),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=8, final_logit_softcapping=0.25, attn_implementation="eager"),
        LogitTransform(softcap=0.25),
    ),
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(logit_scale=4.0, eos_token_id=2, bos_token_id=1),
        LogitTransform(scale=4.0),
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(logits_scaling=0.25),
        LogitTransform(scale=4.0),
    ),
}


def family_model(name: str, seed: int = 0):
    import transformers

    config_name, model_name, extra, _ = FAMILIES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**COMMON, **extra))
    head = model.get_output_embeddings()
    if name == "phi":  # transformers initialises the bias to 0: make it matter
        assert head.bias is not None
        with torch.no_grad():
            head.bias.normal_(generator=torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_takes_the_fused_path_and_matches_its_own_logits(family: str) -> None:
    model = family_model(family)
    assert logit_transform(model) == FAMILIES[family][3]
    assert fused_head_blocker(model) is None
    engine = ActorEngine(model, ActorConfig(micro_batch_size=3, temperature=0.7))
    assert engine.uses_fused_kernel
    batch = make_batch(5, 10, seed=11)
    out = engine.infer_batch(batch)
    expected_lp, expected_ent = reference_logprobs(model, batch, temperature=0.7)
    torch.testing.assert_close(out["logprobs"].double(), expected_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), expected_ent, atol=ATOL, rtol=0)


def _policy_grads(model, policy: PolicyModel, seed: int) -> dict[str, torch.Tensor]:
    """Gradients of ``sum(g1 * logprobs) + sum(g2 * entropy)`` (upstream gradients not 1) at a
    per-token temperature, with an ignored position."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    positions = torch.arange(9).expand(2, 9)
    temperature = torch.rand(2, 9, generator=g) + 0.5
    model.zero_grad(set_to_none=True)
    logprobs, entropy = policy(ids, positions, None, targets, temperature=temperature)
    loss = (logprobs * torch.randn(2, 9, generator=g)).sum()
    loss = loss + (entropy * torch.randn(2, 9, generator=g)).sum()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_gradients_equal_the_models_own_forward(family: str) -> None:
    """The fused head (bias gradient included) against autograd through the model's own head,
    and against the engine's eager twin (``use_fused_kernel=False``: the same transform)."""
    model = family_model(family)
    fused = _policy_grads(model, PolicyModel(model, fused=True), seed=3)
    own = _policy_grads(model, PolicyModel(model, fused=False, plain_head=False), seed=3)
    twin = _policy_grads(model, PolicyModel(model, fused=False, plain_head=True), seed=3)
    assert fused.keys() == own.keys() == twin.keys()
    if family == "phi":
        assert "lm_head.bias" in fused
    for name, want in own.items():
        # fp32 rounding of different summation orders: relative to each gradient's scale.
        atol = 1e-5 * want.abs().max().item()
        torch.testing.assert_close(fused[name], want, atol=atol, rtol=1e-4, msg=name)
        torch.testing.assert_close(twin[name], want, atol=atol, rtol=1e-4, msg=name)


def test_engine_train_step_fused_equals_eager_with_bias() -> None:
    """One optimizer step of the engine with a trainable lm-head bias: same loss and gradients on
    the fused path and the eager one."""
    results = []
    for fused in (True, False):
        engine = ActorEngine(
            family_model("phi"), ActorConfig(micro_batch_size=2, use_fused_kernel=fused)
        )
        assert engine.uses_fused_kernel is fused
        batch = make_batch(4, 9, seed=12)
        batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
        result = engine.forward_backward_batch(batch)
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
        results.append((result["loss"], grads))
    (loss_f, grads_f), (loss_e, grads_e) = results
    assert abs(loss_f - loss_e) < 1e-6
    assert any("lm_head.bias" in name for name in grads_f)
    for name, want in grads_e.items():
        atol = 1e-5 * want.abs().max().item()
        torch.testing.assert_close(grads_f[name], want, atol=atol, rtol=1e-4, msg=name)


def test_probe_compares_against_the_declared_transform() -> None:
    """A forward that scales its logits by 3 while its config declares ``logit_scale``: exact when
    the declaration is right (fused path), caught by the probe when it is wrong (eager path, still
    exact)."""
    from transformers import Qwen2ForCausalLM

    class ScaledLogits(Qwen2ForCausalLM):  # a test-only subclass, no transformers class patched
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    base = tiny_model("qwen2")
    batch = make_batch(3, 8, seed=6)
    for declared, fused in ((3.0, True), (2.0, False)):
        base.config.logit_scale = declared
        model = ScaledLogits(base.config)
        model.load_state_dict(base.state_dict())
        engine = ActorEngine(model, ActorConfig(micro_batch_size=3))
        assert engine.uses_fused_kernel is fused, declared
        expected, _ = reference_logprobs(model, batch)
        torch.testing.assert_close(
            engine.infer_batch(batch)["logprobs"].double(), expected, atol=ATOL, rtol=0
        )


@pytest.mark.parametrize(
    "attr, value",
    [("final_logit_softcapping", 0.0), ("logits_scaling", float("inf")), ("logit_multiplier", 2.0)],
)
def test_transforms_the_kernel_cannot_reproduce_block_the_fused_path(attr, value) -> None:
    model = tiny_model("qwen2")
    setattr(model.config, attr, value)
    assert attr in fused_head_blocker(model)
    with pytest.raises(ValueError, match=attr):
        logit_transform(model)
