"""The routers of a transformers mixture-of-experts model and how each family gates its experts.

Each MoE layer's router is a module (``model._can_record_outputs["router_logits"]``) returning
``(logits [N, E], weights [N, k], experts [N, k])``. A family is supported when the registry
below knows its gating over given experts: what replay needs to keep the router training.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

__all__ = ["GateKind", "RouterSite", "find_routers", "gate_weights", "moe_router_class"]


class GateKind(str, Enum):
    """How a router's gate weights follow from its logits and its chosen experts."""

    #: softmax over all experts, the top-k picked, renormalised over them when
    #: ``norm_topk_prob`` (Qwen3-MoE, OLMoE).
    SOFTMAX_TOPK = "softmax-topk"
    #: the top-k logits picked, softmax over those k (GPT-OSS).
    TOPK_SOFTMAX = "topk-softmax"


# Gating replay reproduces, tested against each model's own code; other routers get no replay
# (a wrong gate would silently train a different model).
_GATES = {
    "Qwen3MoeTopKRouter": GateKind.SOFTMAX_TOPK,
    "OlmoeTopKRouter": GateKind.SOFTMAX_TOPK,
    "GptOssTopKRouter": GateKind.TOPK_SOFTMAX,
}


@dataclass(frozen=True)
class RouterSite:
    """One MoE layer's router: name, instance, gating, ``top_k`` of ``num_experts``, renorm."""

    name: str
    module: nn.Module
    gate: GateKind
    top_k: int
    num_experts: int
    norm_topk_prob: bool


def moe_router_class(model: nn.Module) -> type[nn.Module] | None:
    """The router class a transformers MoE model declares, or None for a dense model."""
    for candidate in model.modules():
        recorders = getattr(type(candidate), "_can_record_outputs", None) or {}
        recorder = recorders.get("router_logits")
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type):
            return target
    return None


def find_routers(model: nn.Module) -> list[RouterSite]:
    """The routers of ``model`` in module order (the routing key's layer axis), ``[]`` if dense;
    ``ValueError`` for a MoE router class without registered gating."""
    router_class = moe_router_class(model)
    if router_class is None:
        return []
    gate = _GATES.get(router_class.__name__)
    if gate is None:
        raise ValueError(
            f"{type(model).__name__}'s router {router_class.__name__} is not supported by routing "
            f"replay and the router losses (supported: {', '.join(sorted(_GATES))})"
        )
    return [
        RouterSite(
            name=name,
            module=module,
            gate=gate,
            top_k=int(module.top_k),
            num_experts=int(module.num_experts),
            norm_topk_prob=bool(getattr(module, "norm_topk_prob", False)),
        )
        for name, module in model.named_modules()
        if isinstance(module, router_class)
    ]


def gate_weights(site: RouterSite, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The gate weights ``[N, k]`` the router of ``site`` gives ``experts`` ``[N, k]`` from its
    ``logits`` ``[N, E]``, differentiable, in the family's own arithmetic and dtypes."""
    if site.gate is GateKind.TOPK_SOFTMAX:
        return torch.softmax(logits.gather(1, experts), dim=1, dtype=logits.dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    picked = probs.gather(1, experts)
    if site.norm_topk_prob:
        picked = picked / picked.sum(dim=-1, keepdim=True)
    return picked.to(logits.dtype)
