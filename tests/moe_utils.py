"""Tiny mixture-of-experts causal LMs built from configs (no download), and MoE references.

Shared by the MoE tests of the engine (tests/engine/moe/), its exports and checkpoints
(tests/engine/checkpoint/) and the 2-rank scenarios (tests/engine/parallel/). Two router
families: Qwen3-MoE (softmax over the experts, then top-k; OLMoE's router is the same code) and
GPT-OSS (top-k of the logits, then a softmax over those k, biased router, attention sinks).
Every model: 2 layers, 4 experts, top-2, hidden 32, vocabulary 128.
"""

from __future__ import annotations

import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 128
HIDDEN = 32
NUM_EXPERTS = 4
TOP_K = 2
NUM_LAYERS = 2
FAMILIES = ("qwen3_moe", "gpt_oss", "olmoe")


def tiny_moe(
    family: str = "qwen3_moe",
    *,
    seed: int = 0,
    dtype=torch.float32,
    eager_experts=None,
    **overrides,
):
    """A 2-layer, 4-expert, top-2 MoE causal LM of ``family`` (one of :data:`FAMILIES`).

    ``eager_experts``: None picks the per-expert loop for float64 (``torch._grouped_mm``, the
    default expert path, rejects float64 on CPU) and keeps the default otherwise. The router
    weights are redrawn with a larger scale so routing is decisive (transformers initialises
    them at zero for Qwen3-MoE and GPT-OSS: every token would tie).
    """
    torch.manual_seed(seed)
    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        num_experts_per_tok=TOP_K,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common, intermediate_size=64, moe_intermediate_size=16, num_experts=NUM_EXPERTS
        )
        cls = Qwen3MoeForCausalLM
    elif family == "olmoe":
        config = OlmoeConfig(
            **common, intermediate_size=16, num_experts=NUM_EXPERTS, eos_token_id=2, pad_token_id=1
        )
        cls = OlmoeForCausalLM
    elif family == "gpt_oss":
        config = GptOssConfig(
            **common,
            intermediate_size=16,
            num_local_experts=NUM_EXPERTS,
            sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        cls = GptOssForCausalLM
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = cls(config)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.normal_(0.0, 0.5)
    model = model.to(dtype)
    if eager_experts is None:
        eager_experts = dtype == torch.float64
    if eager_experts:
        model.set_experts_implementation("eager")
    return model


def router_modules(model) -> list[torch.nn.Module]:
    """The routers of ``model`` in module order (one per MoE layer), found by class name: an
    independent way from the engine's lookup."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The engine's position ids of a ``[B, T]`` mask: ``cumsum - 1`` clamped at 0."""
    return (mask.long().cumsum(1) - 1).clamp_min(0)


def whole_forward_routes(model, batch) -> torch.Tensor:
    """The experts one cache-free forward over ``batch``'s rows routes each token through
    ``[B, T, L, k]``: what a recorded ``routed_experts`` must equal where it was fed."""
    from microrl.engine.moe import RoutingRecorder

    mask = batch["attention_mask"]
    with torch.no_grad(), RoutingRecorder(model) as recorder:
        model(input_ids=batch["input_ids"], attention_mask=mask.long(),
              position_ids=positions(mask), use_cache=False)  # fmt: skip
    return recorder.routes(batch.batch_size[0])


def forced_router_forward(router, routes: torch.Tensor):
    """A router forward that routes token ``n`` through ``routes[n]`` (``[N, k]``) with the
    family's gate weights over those experts, written from the modeling code independently of
    the engine: Qwen3-MoE/OLMoE renormalise the softmax over all experts (``norm_topk_prob``),
    GPT-OSS takes a softmax over the chosen logits."""

    def forward(hidden):
        hidden = hidden.reshape(-1, router.weight.shape[1])
        logits = torch.nn.functional.linear(hidden, router.weight, getattr(router, "bias", None))
        if type(router).__name__.startswith("GptOss"):
            picked = torch.stack([logits[n, routes[n]] for n in range(len(routes))])
            return logits, torch.softmax(picked, dim=1), routes
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        picked = torch.stack([probs[n, routes[n]] for n in range(len(routes))])
        if router.norm_topk_prob:
            picked = picked / picked.sum(-1, keepdim=True)
        return logits, picked.to(logits.dtype), routes

    return forward


def aux_loss_reference(family: str, batch, coef: float) -> tuple[float, dict[str, torch.Tensor]]:
    """The model's own auxiliary loss of the whole ``batch`` in one padded float64 forward
    (``output_router_logits=True``, transformers' ``load_balancing_loss_func``), and the
    gradients of ``coef`` times it, under the engine's parameter names (``causal_lm.*``)."""
    model = tiny_moe(family, dtype=torch.float64)
    mask = batch["attention_mask"]
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=mask.long(),
        position_ids=positions(mask),
        output_router_logits=True,
        use_cache=False,
    )
    (coef * out.aux_loss).backward()
    grads = {
        f"causal_lm.{n}": p.grad if p.grad is not None else torch.zeros_like(p)
        for n, p in model.named_parameters()
    }
    return float(out.aux_loss.detach()), grads
