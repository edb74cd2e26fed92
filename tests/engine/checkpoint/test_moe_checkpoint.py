"""Mixture-of-experts models' checkpoints and exports (single process): LoRA on attention and on
the fused expert weights (peft's ``target_parameters``) exported as a PEFT adapter and as a
merged model, each giving the engine's log-probs; an exact resume with the router loss on. The
2-rank variants are in tests/engine/parallel/test_moe_distributed.py."""

from __future__ import annotations

import pytest
import torch
from distributed_utils import make_batch
from export_utils import check_lm_exports
from moe_utils import tiny_moe

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.engine import ActorEngine
from microrl.losses import RouterLossConfig

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ROUTER_LOSS = RouterLossConfig(aux_loss_coef=0.01, z_loss_coef=0.001)


def _engine(family: str, lora: int, **overrides) -> ActorEngine:
    adapters = LoraConfig(rank=lora, alpha=8.0, target_parameters=EXPERTS if lora else None)
    config = ActorConfig(
        micro_batch_size=2,
        lora=adapters,
        optim=OptimConfig(lr=1e-2, warmup_steps=1, schedule="cosine", total_steps=6),
        router_loss=ROUTER_LOSS,
        **overrides,
    )
    return ActorEngine(tiny_moe(family), config)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_lora_on_attention_and_experts_exports_give_the_engine_logprobs(tmp_path, family):
    engine = _engine(family, lora=4)
    trained = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert any("experts" in n and "lora_B" in n for n in trained), sorted(trained)
    assert any("q_proj.lora_B" in n for n in trained)
    for seed in range(2):  # LoRA B moves away from zero: the merge is not trivial
        engine.train_batch(make_batch(seed=seed))
    experts_b = [p for n, p in engine.module.named_parameters() if "experts" in n and "lora_B" in n]
    assert all(p.abs().sum() > 0 for p in experts_b)
    batch = make_batch(seed=11)
    expected = engine.infer_batch(batch)["logprobs"]
    check_lm_exports(engine, batch, expected, tmp_path, base=lambda: tiny_moe(family))


def test_an_adapted_parameter_refuses_dropout_and_unknown_names_by_key():
    with pytest.raises(ValueError, match=r"lora\.dropout must be 0"):
        ActorEngine(
            tiny_moe("gpt_oss"),
            ActorConfig(lora=LoraConfig(rank=2, dropout=0.1, target_parameters=EXPERTS)),
        )
    with pytest.raises(ValueError, match=r"lora\.target_parameters names \['w9'\].*gate_up_proj"):
        ActorEngine(
            tiny_moe("gpt_oss"), ActorConfig(lora=LoraConfig(rank=2, target_parameters=["w9"]))
        )


def _state(engine) -> dict[str, torch.Tensor]:
    state = {f"param.{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for i, entry in engine.optimizer.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": v.clone() for k, v in entry.items()})
    return state


def test_moe_resume_with_lora_on_experts_is_exact(tmp_path):
    batches = [make_batch(seed=s) for s in range(4)]
    run = _engine("qwen3_moe", lora=4)
    for batch in batches[:2]:
        run.train_batch(batch)
    run.save_checkpoint(tmp_path / "ckpt")
    for batch in batches[2:]:
        run.train_batch(batch)
    torch.manual_seed(99)  # another LoRA initialisation before the load
    resumed = _engine("qwen3_moe", lora=4)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for batch in batches[2:]:
        resumed.train_batch(batch)
    expected, got = _state(run), _state(resumed)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name
