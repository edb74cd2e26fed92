"""Mixture-of-experts models as policies and critics: the engine's log-probs and gradients equal
the model's own (float64, the expert loop), through the fused and the eager head, padded and
packed; what sequence and tensor parallelism do with them; bad input at the boundary."""

from __future__ import annotations

import pytest
import torch
from engine_utils import grads_of, make_batch, reference_logprobs
from moe_utils import NUM_LAYERS, TOP_K, tiny_moe

from microrl.configs import ActorConfig, CriticConfig, LoraConfig, OptimConfig
from microrl.engine import ActorEngine, CriticEngine
from microrl.engine.moe import ROUTED_EXPERTS_KEY
from microrl.losses import RouterLossConfig

SGD = OptimConfig(name="sgd", lr=1.0, grad_clip=None)
# float64 throughout, but Qwen3-MoE's router takes its softmax in float32 (its own code): the
# engine's compact batches and the row-by-row reference round those at different places.
ATOL = 1e-6


def _reference_sft_grads(model, batch) -> dict[str, torch.Tensor]:
    """Gradients of the token-mean NLL of the loss tokens, row by row through the model itself."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    mask = batch["loss_mask"]
    for b in range(batch.batch_size[0]):
        cols = batch["attention_mask"][b].nonzero().squeeze(1)
        row = batch["input_ids"][b, cols][None]
        logp = torch.log_softmax(model(input_ids=row, use_cache=False).logits[0].double(), -1)
        picked = logp[:-1].gather(-1, row[0, 1:, None]).squeeze(-1)
        total = total - (picked * mask[b, cols[1:]]).sum()
    (total / mask.sum()).backward()
    return {
        f"causal_lm.{n}": p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }


@pytest.mark.parametrize(
    ("family", "pack"),
    [("qwen3_moe", False), ("gpt_oss", True)],
    ids=["qwen3_moe", "gpt_oss-packed"],
)
def test_logprobs_and_gradients_are_the_models_through_both_heads(family, pack):
    batch = make_batch(5, 12, padding="mixed", seed=3, dtype=torch.float64)
    expected, _ = reference_logprobs(tiny_moe(family, dtype=torch.float64), batch)
    expected_grads = _reference_sft_grads(tiny_moe(family, dtype=torch.float64), batch)
    mask = batch["attention_mask"]
    for fused in (True, False):
        config = ActorConfig(
            micro_batch_size=2, use_fused_kernel=fused, pack_sequences=pack, optim=SGD
        )
        engine = ActorEngine(tiny_moe(family, dtype=torch.float64), config)
        assert engine.uses_fused_kernel is fused
        got = engine.infer_batch(batch)["logprobs"]
        torch.testing.assert_close(got[mask], expected[mask].float(), atol=ATOL, rtol=0)
        engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)
        for name, grad in grads_of(engine.module).items():
            torch.testing.assert_close(grad, expected_grads[name], atol=ATOL, rtol=0, msg=name)


def test_a_moe_critic_trains_its_value_head_and_body():
    engine = CriticEngine(tiny_moe("gpt_oss"), CriticConfig(micro_batch_size=2, optim=SGD))
    metrics = engine.train_batch(make_batch(4, 10, seed=1))
    assert metrics["step_skipped"] == 0.0
    assert {f"router/layer{i}/load_max" for i in range(NUM_LAYERS)} <= metrics.keys()


def test_sequence_and_tensor_parallelism_refuse_moe_models_naming_the_key():
    from microrl.engine.parallel import sequence_parallel, tensor_parallel

    config = tiny_moe("qwen3_moe").config
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2: model family 'qwen3_moe'"):
        sequence_parallel.check_supported(config, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*qwen3_moe"):
        tensor_parallel.check_supported(config, 2)


def _routes(batch, layers=NUM_LAYERS, k=TOP_K) -> torch.Tensor:
    """A valid key: experts (l + j) % 4 for layer l, slot j, on every token."""
    rows, cols = batch["input_ids"].shape
    ids = torch.tensor([[(layer + j) % 4 for j in range(k)] for layer in range(layers)])
    return ids.to(torch.int16).expand(rows, cols, layers, k).clone()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: r[:, :, :1], r"through 2 MoE layer\(s\).*expected \[B, T, L, k\]"),
        (lambda r: r[..., :1], r"with top-2: expected"),
        (lambda r: r.float(), r"must be an integer tensor"),
        (lambda r: r.index_put_((torch.tensor(1), torch.tensor(4)), torch.tensor(9, dtype=r.dtype))
         , r"row 1, token 4, layer 0 \(model.layers.0.mlp.gate\) has an expert id outside"),
        (lambda r: r.index_put_((torch.tensor(2), torch.tensor(5), torch.tensor(1), torch.tensor(0)),
                                torch.tensor(-1, dtype=r.dtype)),
         r"row 2, token 5, layer 1 .* some but not all"),
        (lambda r: r.index_put_((torch.tensor(0), torch.tensor(6), torch.tensor(1)),
                                torch.tensor(3, dtype=r.dtype)),
         r"row 0, token 6, layer 1 .* an expert chosen twice"),
    ],
    ids=["layers", "top_k", "dtype", "expert_id", "partial", "twice"],
)  # fmt: skip
def test_a_bad_routing_key_names_the_row_and_the_layer(edit, match):
    engine = ActorEngine(tiny_moe("qwen3_moe"), ActorConfig(micro_batch_size=2))
    batch = make_batch(3, 8, padding="none", seed=2)
    batch[ROUTED_EXPERTS_KEY] = edit(_routes(batch))
    with pytest.raises(ValueError, match=match):
        engine.infer_batch(batch)


def test_padding_may_hold_anything_in_the_routing_key():
    engine = ActorEngine(tiny_moe("qwen3_moe"), ActorConfig(micro_batch_size=2))
    batch = make_batch(3, 8, padding="left", seed=2, lengths=[8, 5, 3])
    routes = _routes(batch)
    routes[~batch["attention_mask"]] = 77
    batch[ROUTED_EXPERTS_KEY] = routes
    engine.infer_batch(batch)


def test_a_dense_model_refuses_the_routing_key_and_router_losses():
    from engine_utils import tiny_model

    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2))
    batch = make_batch(3, 8, seed=2)
    batch[ROUTED_EXPERTS_KEY] = _routes(batch)
    with pytest.raises(ValueError, match=r"carries 'routed_experts'.*no mixture-of-experts router"):
        engine.infer_batch(batch)
    config = CriticConfig(router_loss=RouterLossConfig(aux_loss_coef=0.01))
    with pytest.raises(ValueError, match=r"critic\.router_loss\.aux_loss_coef"):
        CriticEngine(tiny_model(), config)


def test_the_moe_config_keys_are_validated_by_name():
    for field, value in (("aux_loss_coef", -0.1), ("z_loss_coef", float("nan"))):
        with pytest.raises(ValueError, match=f"router_loss.{field}"):
            RouterLossConfig(**{field: value})
    with pytest.raises(ValueError, match="routing_replay"):
        ActorConfig(routing_replay="yes")
    with pytest.raises(ValueError, match=r"lora\.target_parameters"):
        LoraConfig(rank=2, target_parameters="experts.down_proj")
