"""The activation model of :func:`~microrl.engine.memory.estimate_memory`: bytes per token of what
autograd keeps in a Llama/Qwen decoder layer, what the offloads move, the lm head's buffers and
a vision tower (docs/gpu.md, "The activation model").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from microrl.configs.engine import EngineConfig
from microrl.engine import offload, setup
from microrl.kernels import WORKING_TILE_ELEMENTS, head_budget_bytes

# The fused kernel's CPU budget in fp32 working tiles; rows per chunk without kernel_chunk_size.
KERNEL_TILES = 4
KERNEL_ROWS = 1024
# The micro-batch's own tensors per token (about eight 8-byte values).
BATCH_BYTES_PER_TOKEN = 64
# [N, V] fp32 buffers of the eager head at its peak (docs/kernels.md).
EAGER_HEAD_BUFFERS = 5
# A policy loss's saved tensors per token (about eight fp32 values and three masks).
LOSS_SAVED_BYTES_PER_TOKEN = 36
# The linear layers of a Llama/Qwen decoder layer, by role (the activation model's layout).
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj")
MLP_INPUTS = ("gate_proj", "up_proj")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and "Layer" in type(module[0]).__name__
        ):
            return list(module)
    return []


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int  # the MLP's width per token: a mixture of experts' k experts together
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    experts: int = 0  # a mixture-of-experts layer's experts (0: a dense MLP)
    top_k: int = 0  # experts per token

    @staticmethod
    def of(model_config: Any) -> Shape:
        text = model_config.get_text_config()
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        experts, top_k = moe_experts(text)
        intermediate = text.intermediate_size
        if experts:  # Qwen-MoE's intermediate_size is its dense layers' (mlp_only_layers)
            intermediate = top_k * (getattr(text, "moe_intermediate_size", None) or intermediate)
        return Shape(
            hidden=text.hidden_size,
            intermediate=intermediate,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            layers=text.num_hidden_layers,
            vocab=text.vocab_size,
            experts=experts,
            top_k=top_k,
        )


def moe_experts(text_config: Any) -> tuple[int, int]:
    """``(experts, top_k)`` of a mixture-of-experts config (Qwen-MoE's ``num_experts``,
    Mixtral's and GPT-OSS's ``num_local_experts``), ``(0, 0)`` for a dense model."""
    experts = getattr(text_config, "num_experts", None) or getattr(
        text_config, "num_local_experts", None
    )
    top_k = getattr(text_config, "num_experts_per_tok", None)
    if not (isinstance(experts, int) and experts > 0 and isinstance(top_k, int)):
        return 0, 0
    return experts, top_k


@dataclass(frozen=True)
class Numerics:
    """Bytes per element of the tensors a layer keeps, by where they come from."""

    stream: int  # the residual stream (embedding output + residual adds)
    act: int  # linear and attention outputs
    saved_input: int  # a trainable layer's own copy of its input (adapter input)
    copies: bool  # each trainable layer keeps its own cast copy of its input
    full: bool  # a full fine-tune (norm weights train too)

    @staticmethod
    def of(config: EngineConfig, autocast: bool, fsdp_bf16: bool) -> Numerics:
        base = setup.base_dtype(config).itemsize
        full = not config.lora.rank
        if fsdp_bf16:  # every parameter gathered in bf16: all bf16, no casts, inputs shared
            return Numerics(stream=2, act=2, saved_input=2, copies=False, full=full)
        if autocast:  # linear outputs bf16; each linear casts its own input to bf16
            return Numerics(stream=base, act=2, saved_input=2, copies=True, full=full)
        # No autocast: peft casts a 16-bit input to the fp32 adapters once per adapted layer.
        return Numerics(
            stream=base,
            act=base,
            saved_input=base if full else 4,
            copies=not full and base < 4,
            full=full,
        )


def adapted_roles(model: nn.Module, config: EngineConfig) -> set[str]:
    """The linear layers of a decoder layer that train (all, or the adapted ones under LoRA)."""
    layers = decoder_layers(model)
    return _trained_names(layers[0], config) if layers else set()


def _trained_names(module: nn.Module, config: EngineConfig) -> set[str]:
    """Last name parts of ``module``'s trained linear layers (the adapted ones under LoRA)."""
    if config.lora.rank:
        return {n.rsplit(".", 1)[-1] for n, m in module.named_modules() if hasattr(m, "lora_A")}
    return {n.rsplit(".", 1)[-1] for n, m in module.named_modules() if isinstance(m, nn.Linear)}


def layer_bytes_per_token(shape: Shape, num: Numerics, adapted: set[str], rank: int) -> int:
    """Bytes autograd keeps per token in one decoder layer (docs/gpu.md, "The activation model")."""
    return sum(layer_tensors(shape, num, adapted, rank))


def layer_tensors(
    shape: Shape, num: Numerics, adapted: set[str], rank: int, *, own_inputs: bool = False
) -> list[int]:
    """Per-token bytes of each tensor autograd keeps in one decoder layer; ``own_inputs``: each
    trainable linear layer's input counted on its own (activation offload copies each view)."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tensors = [h * 4, h * 4, 4, 4]  # the two RMSNorms: their input upcast to fp32, 1/rms per token
    if num.full:  # the norms' weights train: each keeps its normalised input
        tensors += [h * num.stream] * 2
    # Inputs of the trainable linear layers: one shared tensor per group, or a copy per layer.
    for group, width in ((ATTENTION_INPUTS, h), (MLP_INPUTS, h)):
        count = sum(name in adapted for name in group)
        if count:
            tensors += [width * num.saved_input] * (count if num.copies or own_inputs else 1)
    if "o_proj" in adapted:
        tensors.append(q * num.saved_input)
    if "down_proj" in adapted:
        tensors.append(i * num.saved_input)
    # Attention (SDPA / flash): rotated q and k, v, the output, and a logsumexp per head.
    tensors += [q * num.act, kv * num.act, kv * num.act, q * num.act, shape.heads * 4]
    # Gated MLP: the gate, SiLU's output, the up projection (of all k experts for a MoE).
    tensors += [i * num.act] * 3
    if shape.experts:
        # k dispatched inputs, the gated product, k weighted outputs; router logits, softmax.
        tensors += [2 * shape.top_k * h * num.act, i * num.act, shape.experts * 4 * 2]
    if rank:  # each adapter's low-rank activation (lora_B's input)
        tensors += [rank * num.saved_input] * len(adapted)
    return tensors


def offloaded_activations(
    shape: Shape,
    num: Numerics,
    adapted: set[str],
    config: EngineConfig,
    tokens: int,
    per_layer: int,
) -> tuple[int, int, int]:
    """``(forward, backward, host)`` bytes of a micro-batch's saved tensors under
    ``activation_offload`` (docs/gpu.md, "Offloads").

    Saved tensors of at least :data:`~microrl.engine.offload.MIN_OFFLOAD_BYTES` go to the host;
    the device keeps the smaller ones, the largest copies in flight (``offload.MAX_IN_FLIGHT``
    forward, ``1 + offload.PREFETCH`` backward) and, with checkpointing, one recomputed layer.
    """
    h, min_bytes = shape.hidden, offload.MIN_OFFLOAD_BYTES
    if config.gradient_checkpointing:
        layer = copied = [h * num.stream]
    else:  # each copied view of a shared tensor is a copy of its own
        layer = layer_tensors(shape, num, adapted, config.lora.rank)
        copied = layer_tensors(shape, num, adapted, config.lora.rank, own_inputs=True)
        copied += [shape.head_dim * num.stream] * 2  # each layer's views of rotary cos and sin
    outside = [h * 4, 4, LOSS_SAVED_BYTES_PER_TOKEN]
    if num.full:  # the final norm's weight trains: it keeps its normalised input too
        outside.append(h * num.stream)

    def moves(per_token: int) -> bool:
        return tokens * per_token >= min_bytes

    moved = [b for b in copied if moves(b)]
    host = tokens * (shape.layers * sum(moved) + sum(b for b in outside if moves(b)))
    # What the model without offload keeps, less what moved (storage shared as without hooks).
    kept = shape.layers * sum(b for b in layer if not moves(b)) + other_bytes_per_token(shape, num)
    kept -= h * 4 if moves(h * 4) else 0  # the final norm's fp32 input
    largest = sorted(moved * shape.layers, reverse=True)
    forward = tokens * (kept + sum(largest[: offload.MAX_IN_FLIGHT]))
    backward = tokens * (kept + sum(largest[: 1 + offload.PREFETCH]))
    if config.gradient_checkpointing:
        backward += tokens * per_layer
    return forward, backward, host


def backward_bytes_per_token(shape: Shape, num: Numerics) -> int:
    """Activation gradients in flight in one layer's backward: the output's and one MLP-wide one."""
    return shape.hidden * num.stream + shape.intermediate * max(num.act, num.saved_input)


def other_bytes_per_token(shape: Shape, num: Numerics) -> int:
    """Outside the layers: final norm, hidden state and gradient, rotary, batch tensors."""
    h = shape.hidden
    return h * 4 + 2 * h * num.stream + 2 * shape.head_dim * num.act + BATCH_BYTES_PER_TOKEN


def head_bytes(shape: Shape, num: Numerics, config: EngineConfig, tokens: int, device: str) -> int:
    """The lm head's buffers: the fused kernel's fp32 logits tiles (CPU: its tile budget and a fp32
    copy of a 16-bit vocabulary tile; CUDA: its byte budget, at most the logits and a gradient
    accumulator), or the eager head's ``[N, V]`` fp32 buffers."""
    if not config.use_fused_kernel:
        return EAGER_HEAD_BUFFERS * tokens * shape.vocab * 4
    if device == "cuda":
        fused = getattr(config, "fuse_loss", False)
        budget = head_budget_bytes(tokens, shape.vocab, shape.hidden, fused_loss=fused)
        return min(budget, 4 * tokens * (shape.vocab + shape.hidden))
    chunk = config.kernel_chunk_size or KERNEL_ROWS
    vocab_tile = min(shape.vocab, max(128, WORKING_TILE_ELEMENTS // chunk))
    working = 2 * min(chunk, tokens) * vocab_tile
    tiles = min(KERNEL_TILES * WORKING_TILE_ELEMENTS, tokens * shape.vocab + working)
    upcast = vocab_tile * shape.hidden * 4 if (num.stream < 4 and device != "cuda") else 0
    return tiles * 4 + upcast


# A Qwen-VL vision block's linear layers by the decoder-layer role of the same widths.
_VISION_ROLES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "proj": ("o_proj",),
    "fc1": ("up_proj",),
    "fc2": ("down_proj",),
}


def vision_tower_bytes(
    vision_config: Any, tower: nn.Module, config: EngineConfig, num: Numerics, image_tokens: int
) -> tuple[int, int]:
    """``(kept, forward_peak)``: bytes a vision tower keeps for the backward over ``image_tokens``
    placeholders (``merge**2`` patches each), each block modelled as a decoder layer; a frozen
    tower keeps nothing and holds one block at a time."""
    patches = image_tokens * vision_config.spatial_merge_size**2
    hidden = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
    intermediate = getattr(vision_config, "intermediate_size", None)
    intermediate = intermediate or int(hidden * vision_config.mlp_ratio)
    heads = vision_config.num_heads
    shape = Shape(hidden, intermediate, heads, heads, hidden // heads, vision_config.depth, 0)
    patch_dim = (
        vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    )
    out = getattr(vision_config, "out_hidden_size", None) or vision_config.hidden_size
    inputs = patches * patch_dim * 4 + image_tokens * out * num.act  # pixels, merged features
    adapted = _tower_roles(tower, config)
    if not any(p.requires_grad for p in tower.parameters()):
        return 0, inputs + patches * layer_bytes_per_token(shape, num, set(), 0)
    per_block = layer_bytes_per_token(shape, num, adapted, config.lora.rank)
    if config.gradient_checkpointing:  # each block keeps its input; backward recomputes one
        kept = patches * (shape.layers * hidden * num.stream + per_block)
    else:
        kept = patches * shape.layers * per_block
    return kept + inputs, kept + inputs


def _tower_roles(tower: nn.Module, config: EngineConfig) -> set[str]:
    """The decoder-layer roles of the tower's trained linear layers (its first block's)."""
    blocks = next((m for m in tower.modules() if isinstance(m, nn.ModuleList) and len(m)), None)
    if blocks is None:
        return set()
    names = _trained_names(blocks[0], config)
    return {role for name in names for role in _VISION_ROLES.get(name, (name,))}
