"""Parameter, gradient and optimizer bytes for :func:`~microrl.engine.memory.estimate_memory`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from microrl.configs.engine import EngineConfig
from microrl.engine import setup
from microrl.engine.memory_activations import decoder_layers
from microrl.engine.memory_models import shard_numel
from microrl.engine.vision import vision_spec

__all__ = ["ParamBytes", "meta_model"]


def meta_model(model_config: Any, config: EngineConfig, value_head: bool) -> nn.Module:
    """The model as the engine prepares it, on ``meta``: base dtype, LoRA, a value head."""
    with torch.device("meta"):
        model = setup.auto_model_class(model_config).from_config(
            model_config, dtype=setup.base_dtype(config)
        )
    spec = vision_spec(model)
    frozen = spec is not None and config.freeze_vision
    exclude = spec.tower_module_names(model) if frozen else None
    # On meta too: peft builds target_parameters' adapters (MoE experts) on the default device.
    with torch.device("meta"):
        model, _ = setup.apply_lora(model, config.lora, exclude=exclude)
    if frozen:
        vision_spec(model).tower.requires_grad_(False)
    if value_head:  # the critic's Linear(H, 1) head, fp32 and trainable (engine/models.py)
        hidden = model.config.get_text_config().hidden_size
        model.add_module("value_head", nn.Linear(hidden, 1, device="meta", dtype=torch.float32))
    return model


@dataclass(frozen=True)
class ParamBytes:
    frozen: int
    trainable: int
    gradients: int
    optimizer: int
    num_params: int
    num_trainable: int
    trainable_numel_per_rank: int
    trainable_linear_numel: int  # weights of trainable linear layers but the head (autocast)
    trainable_head_numel: int  # the output head's weight when it trains
    largest_weight: int  # elements of the largest trainable weight of a decoder layer
    layer_numel: int  # the largest decoder layer, adapters included
    root_numel: int  # FSDP's root unit: the output head and the final norm
    base_itemsize: int
    base_numel: int  # the causal LM's own elements (no adapters): what vLLM holds
    expert_numel: int = 0  # a mixture of experts' expert weights (all layers, no adapters)

    def placement(self, cpu_offload: bool) -> dict[str, int]:
        """The device and ``host_*`` bytes of parameters and optimizer state: on the host with
        ``optim.cpu_offload`` (with this rank's fp32 gradient shards; the device still
        accumulates full-size gradients over the micro-batches)."""
        device = {
            "weights": self.frozen,
            "trainable_params": self.trainable,
            "optimizer_state": self.optimizer,
        }
        host = {
            "host_params": self.frozen + self.trainable,
            "host_gradients": self.trainable,
            "host_optimizer_state": self.optimizer,
        }
        return {**device, **host, **dict.fromkeys(device if cpu_offload else host, 0)}

    @staticmethod
    def count(model: nn.Module, world_size: int) -> ParamBytes:
        """Bytes per rank: each tensor sharded on dim 0 (FSDP2 pads it to a multiple of the
        world size); AdamW holds two fp32 moments per element and a 0-d fp32 step per tensor."""
        frozen = trainable = trainable_numel = n_params = n_trainable = n_tensors = 0
        itemsize = 4
        for p in model.parameters():
            numel = shard_numel(p, world_size)
            n_params += p.numel()
            if p.requires_grad:
                trainable += numel * p.element_size()
                trainable_numel += numel
                n_trainable += p.numel()
                n_tensors += 1
            else:
                frozen += numel * p.element_size()
                itemsize = p.element_size()
        # Full-size gradients (fp32, like the trainable parameters) on every rank.
        gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        layers = decoder_layers(model)
        head = model.get_output_embeddings()
        norm = getattr(model.get_decoder(), "norm", None)
        return ParamBytes(
            frozen=frozen,
            trainable=trainable,
            gradients=gradients,
            optimizer=8 * trainable_numel + 4 * n_tensors,
            num_params=n_params,
            num_trainable=n_trainable,
            trainable_numel_per_rank=trainable_numel,
            trainable_linear_numel=sum(
                p.numel()
                for m in model.modules()
                if isinstance(m, nn.Linear) and m is not head
                for p in m.parameters(recurse=False)
                if p.requires_grad and p.dim() == 2
            ),
            trainable_head_numel=sum(p.numel() for p in _params(head) if p.requires_grad),
            largest_weight=max(
                (p.numel() for layer in layers for p in layer.parameters() if p.requires_grad),
                default=0,
            ),
            layer_numel=max((_numel(layer) for layer in layers), default=0),
            root_numel=_numel(head) + _numel(norm),
            base_itemsize=itemsize,
            base_numel=sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
            expert_numel=sum(
                p.numel()
                for n, p in model.named_parameters()
                if ".experts." in n and "lora_" not in n
            ),
        )


def _params(module: nn.Module | None) -> list[nn.Parameter]:
    return [] if module is None else list(module.parameters())


def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in _params(module))
