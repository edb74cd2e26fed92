"""RL-safe defaults and outputs on request: dropout off, entropy for a custom loss, LoRA targets
that fit the architecture, device errors that name the key, empty mini-batches, empty extremes."""

from __future__ import annotations

import math

import pytest
import torch
from engine_utils import VOCAB, grads_of, make_batch, tiny_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from microrl.configs import ActorConfig, LoraConfig, OptimConfig, load_config
from microrl.configs.examples import GRPOExampleConfig
from microrl.engine import ActorEngine
from microrl.losses import Metric, masked_partial_mean

# First on-policy ratio: 1 up to fp32 GEMM rounding between two micro-batchings (see
# test_engine_train.RATIO_TOL); dropout at 0.1..0.5 moves log-probs by ~1e-1.
RATIO_TOL = 1e-5


def _model(arch: str, **overrides) -> nn.Module:
    """Tiny GPT-2 (Conv1D layers, dropout 0.1 in nn.Dropout modules), OPT (q/k/v/out_proj,
    fc1/fc2; dropout 0.1 as float attributes), or Qwen2 from engine_utils; no download."""
    torch.manual_seed(0)
    if arch == "gpt2":
        config = GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0, **overrides,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    if arch == "opt":
        config = OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, word_embed_proj_dim=32, max_position_embeddings=64, **overrides,
        )  # fmt: skip
        return OPTForCausalLM(config)
    return tiny_model(arch, **overrides)


DROPOUT_MODELS = {
    "gpt2": {},  # attn_pdrop = resid_pdrop = embd_pdrop = 0.1 (defaults)
    "opt": {},  # dropout = 0.1 (default), read functionally from a float attribute
    "qwen2": {"attention_dropout": 0.5},  # read in forward as self.attention_dropout
}


def _on_policy_ratios(arch: str, **config) -> dict[str, float]:
    engine = ActorEngine(_model(arch, **DROPOUT_MODELS[arch]), ActorConfig(**config))
    batch = make_batch(6, 12, seed=1)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    return engine.forward_backward_batch(batch)["metrics"]


@pytest.mark.parametrize("arch", list(DROPOUT_MODELS))
def test_dropout_is_off_in_training_passes_by_default(arch: str) -> None:
    metrics = _on_policy_ratios(arch, micro_batch_size=2)
    assert abs(metrics["ratio_min"] - 1) <= RATIO_TOL and abs(metrics["ratio_max"] - 1) <= RATIO_TOL
    assert metrics["pg_clipfrac"] == 0.0
    noisy = _on_policy_ratios(arch, micro_batch_size=2, disable_dropout=False)
    assert noisy["ratio_max"] - noisy["ratio_min"] > 1e-2, "dropout was never active: no test"


def test_disable_dropout_is_a_config_key_of_the_examples() -> None:
    assert ActorConfig().disable_dropout is True
    cfg = load_config(GRPOExampleConfig, None, ["actor.disable_dropout=false"])
    assert cfg.actor.disable_dropout is False


def _entropy_loss(seen: list[bool]):
    def loss_fn(output, micro_batch, denominators):
        seen.append("entropy" in output)
        mask = micro_batch["loss_mask"]
        entropy = torch.where(mask, output["entropy"], 0.0)
        metrics = {"entropy": Metric(masked_partial_mean(output["entropy"], mask, denominators))}
        return -entropy.sum() / denominators.n_tokens, metrics

    return loss_fn


def test_a_custom_loss_gets_the_entropy_and_its_gradient_on_request() -> None:
    batch = make_batch(4, 10, seed=2).select("input_ids", "attention_mask", "loss_mask")
    grads = {}
    for fused in (True, False):
        config = ActorConfig(
            micro_batch_size=2,
            use_fused_kernel=fused,
            compute_entropy=True,
            check_grad_flow="error",
        )
        engine = ActorEngine(tiny_model(), config)
        assert engine.uses_fused_kernel is fused
        seen: list[bool] = []
        result = engine.forward_backward_batch(batch, loss_fn=_entropy_loss(seen))
        assert seen == [True, True] and result["metrics"]["entropy"] > 0
        grads[fused] = grads_of(engine.module)  # the audit above: every parameter got one
        assert all(g.abs().max() > 0 for g in grads[fused].values())
    for name, grad in grads[True].items():  # the kernel's entropy gradient is the eager one
        torch.testing.assert_close(grad, grads[False][name], rtol=1e-4, atol=1e-6, msg=name)
    # The built-in loss then reports the entropy metric of training passes too.
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    batch["advantages"] = torch.ones(batch["input_ids"].shape)
    assert "entropy" in engine.forward_backward_batch(batch)["metrics"]


def test_entropy_is_not_computed_in_training_passes_unless_asked() -> None:
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2))
    batch = make_batch(4, 10, seed=3)
    seen: list[bool] = []
    with pytest.raises(KeyError, match="entropy"):
        engine.forward_backward_batch(batch, loss_fn=_entropy_loss(seen))
    assert seen == [False]
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    result = engine.forward_backward_batch(batch)
    assert "entropy" not in result["model_output"] and "entropy" not in result["metrics"]
    assert "entropy" in engine.infer_batch(batch)  # inference always returns it


@pytest.mark.parametrize(
    ("arch", "expected"),
    [("gpt2", {"c_attn", "c_proj", "c_fc"}), ("opt", {"q_proj", "k_proj", "v_proj", "out_proj"})],
)
def test_default_lora_targets_fit_the_architecture(arch: str, expected: set[str]) -> None:
    config = ActorConfig(
        micro_batch_size=3, lora=LoraConfig(rank=4), optim=OptimConfig(lr=1e-2, grad_clip=None)
    )
    engine = ActorEngine(_model(arch), config)
    adapted = {
        n.rsplit(".", 1)[-1] for n, m in engine.model.named_modules() if hasattr(m, "lora_A")
    }
    assert expected <= adapted and "lm_head" not in adapted
    assert type(engine.model.get_output_embeddings()) is nn.Linear  # the fused kernel's weight
    assert engine.uses_fused_kernel
    trainable = {
        n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad
    }
    assert trainable and all("lora_" in n for n in trainable)
    batch = make_batch(6, 12, seed=4)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    metrics = engine.train_batch(batch)
    assert metrics["step_skipped"] == 0.0 and engine.global_step == 1
    params = dict(engine.module.named_parameters())
    moved = [n for n in trainable if not torch.equal(params[n], trainable[n])]
    assert any("lora_B" in n for n in moved), "LoRA parameters did not move"


def test_lora_target_modules_accepts_peft_strings_and_checks_lists() -> None:
    assert LoraConfig(rank=4, target_modules="all-linear").target_modules == "all-linear"
    override = ["actor.lora.target_modules=all-linear"]
    assert load_config(GRPOExampleConfig, None, override).actor.lora.target_modules == "all-linear"
    with pytest.raises(ValueError, match=r"actor\.lora\.target_modules"):
        load_config(GRPOExampleConfig, None, ["actor.lora.target_modules=3"])

    def adapted(target_modules) -> set[str]:
        config = ActorConfig(lora=LoraConfig(rank=4, target_modules=target_modules))
        engine = ActorEngine(tiny_model(), config)
        return {n for n, m in engine.model.named_modules() if hasattr(m, "lora_A")}

    qwen_layers = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert adapted("all-linear") == adapted(None) == adapted(qwen_layers)
    with pytest.raises(ValueError, match=r"lora\.target_modules.*'nope'.*c_attn"):
        ActorEngine(_model("gpt2"), ActorConfig(lora=LoraConfig(rank=4, target_modules=["nope"])))


def test_unavailable_or_unknown_devices_are_config_errors() -> None:
    with pytest.raises(ValueError, match=r"device must be .*'nonsense'"):
        ActorConfig(device="nonsense")
    with pytest.raises(ValueError, match=r"bad value for config key 'actor\.device'"):
        load_config(GRPOExampleConfig, None, ["actor.device=nonsense"])
    missing = "cuda:99" if torch.cuda.is_available() else "cuda"
    message = r"visible" if torch.cuda.is_available() else r"no cuda device is available.*'auto'"
    with pytest.raises(ValueError, match=rf"device='{missing}'.*{message}"):
        ActorEngine(tiny_model(), ActorConfig(device=missing))


def test_a_mini_batch_without_loss_tokens_is_not_an_optimizer_step() -> None:
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=3)  # AdamW would still move
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2, optim=optim))
    batch = make_batch(4, 10, seed=5)
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    engine.train_batch(batch)  # a real step first: AdamW has momentum to apply
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in engine.optimizer.state.items()}
    lr = engine.optimizer.param_groups[0]["lr"]

    empty = batch.clone()
    empty["loss_mask"] = torch.zeros_like(empty["loss_mask"])
    metrics = engine.train_batch(empty)
    assert metrics["step_skipped"] == 1.0 and metrics["loss"] == 0.0
    assert engine.global_step == 1 and engine.optimizer.param_groups[0]["lr"] == lr
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, params[name]), name
        assert p.grad is None
    for p, s in engine.optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    # Extremes over no token at all are "no value" (NaN), not a ratio of 0; the other metrics,
    # means over no token, stay 0 and finite.
    assert math.isnan(metrics["ratio_min"]) and math.isnan(metrics["ratio_max"])
    assert metrics["pg_clipfrac"] == 0.0 and math.isfinite(metrics["ppo_kl"])

    metrics = engine.train_batch(batch)  # a normal batch after it steps normally
    assert metrics["step_skipped"] == 0.0 and engine.global_step == 2
    assert engine.optimizer.param_groups[0]["lr"] > lr  # warmup advanced
    assert math.isfinite(metrics["ratio_min"]) and math.isfinite(metrics["ratio_max"])
    assert any(not torch.equal(p, params[n]) for n, p in engine.module.named_parameters())
