"""How many bytes an engine needs per device, before building it: :func:`estimate_memory`.

Parameters, gradients and optimizer state are exact: the model is built on ``meta`` and
prepared as the engine prepares it. Activations follow a per-layer model checked against measured
bytes (tests/engine/test_memory_estimate.py). Fields, the activation model and the offloads
(reported apart, on the host): docs/gpu.md#estimate_memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from microrl.configs.engine import EngineConfig
from microrl.engine.memory_activations import (
    Numerics,
    Shape,
    adapted_roles,
    backward_bytes_per_token,
    head_bytes,
    layer_bytes_per_token,
    offloaded_activations,
    other_bytes_per_token,
    vision_tower_bytes,
)
from microrl.engine.memory_models import (
    hf_gathered_bytes,
    image_token_bytes,
    reward_model_bytes,
    teacher_bytes,
)
from microrl.engine.memory_params import ParamBytes, meta_model
from microrl.engine.vision import vision_spec

__all__ = ["MemoryEstimate", "estimate_memory"]

GiB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of one engine's training step, and host bytes under the offloads
    (``host_*``); fields: docs/gpu.md, "``estimate_memory``". Not counted: the CUDA context,
    fragmentation."""

    weights: int
    trainable_params: int
    gradients: int
    optimizer_state: int
    activations: int
    head_buffers: int
    autocast_copies: int
    backward_gradients: int
    compute_peak: int
    fsdp_buffers: int
    optimizer_transient: int
    vllm: int
    total: int
    # What the numbers were computed for.
    num_params: int
    num_trainable: int
    tokens: int
    world_size: int
    peak_phase: str  # "forward at the head", "backward" or "optimizer step"
    device_memory: int | None = None
    # Host memory (the offloads; 0 without them).
    host_params: int = 0
    host_gradients: int = 0
    host_optimizer_state: int = 0
    host_activations: int = 0
    host_total: int = 0
    vllm_sleep_level: int = 0
    host_vllm_weights: int = 0
    # On-policy distillation's frozen teacher (``teacher_config``; 0 without one).
    teacher_weights: int = 0
    teacher_forward: int = 0
    # A vision-language model's tower over the micro-batch's image patches (0 for text).
    vision_activations: int = 0
    # A task.reward_model (``reward_model_config``; 0 without one).
    reward_model_weights: int = 0
    reward_model_forward: int = 0
    # hf generation under FSDP2: the policy's full weights gathered beside the shards.
    hf_gathered_weights: int = 0
    # Images: pixel bytes per image token, and the step's pixels (one copy per group).
    image_token_bytes: int = 0
    image_pixels: int = 0
    # A mixture of experts: parameters one token uses, routing key (routed_experts) bytes.
    num_active_params: int = 0
    routing_key_bytes_per_token: int = 0

    @property
    def persistent(self) -> int:
        """Bytes that live for the whole run: parameters, gradients, optimizer state."""
        return self.weights + self.trainable_params + self.gradients + self.optimizer_state

    @property
    def fits(self) -> bool | None:
        """Whether ``total`` fits the given device memory (None when none was given)."""
        return None if self.device_memory is None else self.total <= self.device_memory

    def __str__(self) -> str:
        rows = [
            ("weights (frozen)", self.weights),
            ("trainable params (fp32)", self.trainable_params),
            ("gradients (fp32)", self.gradients),
            ("optimizer state", self.optimizer_state),
            (f"activations ({self.tokens} tokens)", self.activations),
            ("lm-head buffers", self.head_buffers),
            ("autocast weight copies", self.autocast_copies),
            ("gradients in flight", self.backward_gradients),
            ("= forward/backward peak", self.compute_peak),
            ("FSDP gathered weights", self.fsdp_buffers),
            ("optimizer-step transient", self.optimizer_transient),
            (
                "vLLM share" + (" (asleep while training)" if self.vllm_sleep_level else ""),
                self.vllm,
            ),
        ]
        if self.vision_activations:
            rows.insert(5, ("vision tower activations", self.vision_activations))
        if self.teacher_weights:
            rows += [
                ("teacher weights (frozen)", self.teacher_weights),
                ("teacher forward", self.teacher_forward),
            ]
        if self.reward_model_weights:
            rows += [
                ("reward model weights (frozen)", self.reward_model_weights),
                ("reward model forward", self.reward_model_forward),
            ]
        if self.image_pixels:
            rows.append(("image pixels (the step's)", self.image_pixels))
        if self.hf_gathered_weights:
            rows.append(("hf generation: gathered weights", self.hf_gathered_weights))
        rows.append((f"total (peak: {self.peak_phase})", self.total))
        if self.host_total:
            host = {
                "parameters": self.host_params,
                "gradients": self.host_gradients,
                "optimizer state": self.host_optimizer_state,
                "activations": self.host_activations,
                "vLLM weights (asleep)": self.host_vllm_weights,
                "total": self.host_total,
            }
            rows += [(f"host: {name}", value) for name, value in host.items()]
        width = max(len(name) for name, _ in rows) + 2
        active = ""
        if self.num_active_params and self.num_active_params != self.num_params:
            active = f" ({self.num_active_params / 1e9:.3g}B active per token)"
        lines = [
            f"{self.num_params / 1e9:.3g}B params{active}, {self.num_trainable / 1e6:.4g}M "
            f"trainable, {self.tokens} tokens per micro-batch, {self.world_size} rank(s); "
            "per device:"
        ]
        lines += [f"  {name:<{width}}{_gib(value):>11}" for name, value in rows]
        if self.image_token_bytes:
            lines.append(f"  pixels per image token: {self.image_token_bytes} bytes")
        if self.routing_key_bytes_per_token:
            lines.append(
                f"  routing key (routing replay): {self.routing_key_bytes_per_token} bytes per token"
            )
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in {_gib(self.device_memory).strip()}")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def estimate_memory(
    model_config: Any,
    config: EngineConfig | None = None,
    *,
    tokens_per_micro_batch: int | None = None,
    world_size: int = 1,
    device: str = "cuda",
    value_head: bool = False,
    vllm_gpu_memory_utilization: float | None = None,
    device_memory: int | None = None,
    vllm_sleep_level: int = 0,
    teacher_config: Any = None,
    image_tokens_per_micro_batch: int = 0,
    image_tokens_per_step: int = 0,
    reward_model_config: Any = None,
    reward_model_tokens: int | None = None,
    hf_generation: bool | None = None,
) -> MemoryEstimate:
    """The bytes one device needs to train ``model_config``'s model (a transformers
    ``PretrainedConfig``) with ``config`` (default ``EngineConfig()``).

    ``tokens_per_micro_batch`` defaults to ``config.max_tokens_per_micro_batch``; ``world_size``
    counts FSDP2 ranks. The other arguments: docs/gpu.md#estimate_memory.

    Raises:
        ValueError: naming the argument: no token budget, ``world_size < 1``, a vLLM share
            without ``device_memory`` or outside (0, 1].
    """
    config = EngineConfig() if config is None else config
    tokens = tokens_per_micro_batch or config.max_tokens_per_micro_batch
    if not tokens or tokens < 1:
        raise ValueError(
            "tokens_per_micro_batch must be >= 1 (or set config.max_tokens_per_micro_batch), "
            f"got {tokens_per_micro_batch!r}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    vllm = 0
    if vllm_gpu_memory_utilization is not None:
        if not 0 < vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm_gpu_memory_utilization must be in (0, 1], got {vllm_gpu_memory_utilization}"
            )
        if device_memory is None:
            raise ValueError("vllm_gpu_memory_utilization needs device_memory (bytes)")
        vllm = int(vllm_gpu_memory_utilization * device_memory)
    if vllm_sleep_level not in (0, 1, 2):
        raise ValueError(f"vllm_sleep_level must be 0, 1 or 2, got {vllm_sleep_level!r}")
    # What the numbers are computed for.
    inputs = {
        "tokens": tokens,
        "world_size": world_size,
        "device_memory": device_memory,
        "vllm_sleep_level": vllm_sleep_level,
    }
    model = meta_model(model_config, config, value_head)
    if image_tokens_per_micro_batch and getattr(model_config, "vision_config", None) is None:
        raise ValueError(
            "image_tokens_per_micro_batch needs a vision-language model_config (with a "
            f"vision_config), got {type(model_config).__name__}"
        )
    params = ParamBytes.count(model, world_size)
    shape = Shape.of(model_config)
    autocast = config.dtype == "bfloat16" or (config.dtype == "auto" and device == "cuda")
    # FSDP2 shards over the ranks, and over one rank in one process for optim.cpu_offload.
    cpu_offload = config.optim.cpu_offload
    sharded = world_size > 1 or cpu_offload
    # FSDP2 on CUDA gathers parameters in bf16 (engine/parallel/distributed.py).
    fsdp_bf16 = sharded and device == "cuda"
    numerics = Numerics.of(config, autocast, fsdp_bf16)
    adapted = adapted_roles(model, config)
    per_layer = layer_bytes_per_token(shape, numerics, adapted, config.lora.rank)
    host_activations = 0
    if config.activation_offload:
        forward, backward, host_activations = offloaded_activations(
            shape, numerics, adapted, config, tokens, per_layer
        )
    elif config.gradient_checkpointing:  # each layer keeps its input; backward recomputes one
        other = other_bytes_per_token(shape, numerics)
        kept = tokens * (shape.layers * shape.hidden * numerics.stream + other)
        forward, backward = kept, kept + tokens * per_layer
    else:
        other = other_bytes_per_token(shape, numerics)
        forward = backward = tokens * (shape.layers * per_layer + other)
    head = 0
    if not value_head:
        head = head_bytes(shape, numerics, config, tokens, device)
        # A trainable head's weight gradient is formed in the fused head's forward (fp32).
        head += 4 * params.trainable_head_numel
    # Autocast caches the bf16 cast of each weight that requires grad for the whole forward.
    copies = 2 * params.trainable_linear_numel if autocast and not fsdp_bf16 else 0
    # Plus, when weights train, one weight gradient before it is added into ``.grad``.
    in_flight = tokens * backward_bytes_per_token(shape, numerics) + 4 * params.largest_weight
    phases = {"forward at the head": forward + head + copies, "backward": backward + in_flight}
    vision = 0
    if image_tokens_per_micro_batch:
        tower = vision_spec(model).tower
        vision, tower_peak = vision_tower_bytes(
            model_config.vision_config, tower, config, numerics, image_tokens_per_micro_batch
        )
        # A trained tower's activations live from the model's first op to its last backward.
        phases = {name: value + vision for name, value in phases.items()}
        phases["vision tower forward"] = tower_peak
    compute_phase = max(phases, key=phases.get)
    gathered = 0
    if sharded:
        # The root unit (final norm, head) for the whole step, the current and next layer.
        gather_size = 2 if fsdp_bf16 else params.base_itemsize
        gathered = (params.root_numel + 2 * params.layer_numel) * gather_size
    # AdamW (foreach)'s fp32 temporary per trainable element: on the host with cpu_offload.
    step = params.trainable_numel_per_rank * 4 if config.optim.name == "adamw" else 0
    host_step = step if cpu_offload else 0
    step -= host_step
    peak_phase = compute_phase if phases[compute_phase] >= step else "optimizer step"
    placed = params.placement(cpu_offload)  # the offload's host_* bytes too
    # Sleep level 1: vLLM's weights wait in host memory, in its dtype.
    host_vllm = 0
    if vllm and vllm_sleep_level == 1:
        host_vllm = params.base_numel * (2 if autocast else params.base_itemsize)
    hosted = sum(value for name, value in placed.items() if name.startswith("host_"))
    persistent = sum(placed.values()) - hosted + params.gradients
    training = persistent + gathered + max(phases[compute_phase], step)
    if vllm and vllm_sleep_level:  # vLLM's share only while it samples, the trainer idle
        total = max(training, persistent + vllm)
        if persistent + vllm > training:
            peak_phase = "sampling"
    else:
        total = training + vllm
    teacher, rm, images = {}, {}, {}
    if teacher_config is not None:
        teacher = teacher_bytes(teacher_config, config, tokens, world_size, device, numerics)
        total += sum(teacher.values())
    if reward_model_config is not None:
        rm_tokens = reward_model_tokens or tokens
        rm = reward_model_bytes(reward_model_config, config, rm_tokens, world_size, device)
        total += sum(rm.values())
    if getattr(model_config, "vision_config", None) is not None:
        per_token = image_token_bytes(model_config.vision_config)
        images = {"image_token_bytes": per_token, "image_pixels": image_tokens_per_step * per_token}
        total += images["image_pixels"]
    # hf sampling: the idle trainer without gradients, frozen models, the policy gathered whole.
    hf = vllm_gpu_memory_utilization is None if hf_generation is None else hf_generation
    gathered_hf = hf_gathered_bytes(model, world_size, device, sharded) if hf else 0
    frozen = teacher.get("teacher_weights", 0) + rm.get("reward_model_weights", 0)
    sampling = persistent - params.gradients + frozen + gathered_hf
    if gathered_hf and sampling > total:
        total, peak_phase = sampling, "hf sampling"
    compute = {
        "activations": max(forward, backward),
        "head_buffers": head,
        "autocast_copies": copies,
        "backward_gradients": in_flight,
        "compute_peak": phases[compute_phase],
        "vision_activations": vision,
    }
    host = {
        "host_activations": host_activations,
        "host_vllm_weights": host_vllm,
        "host_total": hosted + host_vllm + max(host_activations, host_step),
    }
    return MemoryEstimate(
        **placed,
        **compute,
        **host,
        **inputs,
        gradients=params.gradients,
        num_params=params.num_params,
        num_trainable=params.num_trainable,
        fsdp_buffers=gathered,
        optimizer_transient=step,
        vllm=vllm,
        total=total,
        peak_phase=peak_phase,
        hf_gathered_weights=gathered_hf,
        **teacher,
        **rm,
        **images,
        **_moe_counts(model, shape, params),
    )


def _moe_counts(model: Any, shape: Shape, params: ParamBytes) -> dict[str, int]:
    """A mixture of experts' active parameters per token and routing-key bytes per token."""
    from microrl.engine.moe.routers import moe_router_class
    from microrl.engine.moe.routes import routes_dtype

    if not shape.experts:
        return {"num_active_params": params.num_params}
    idle = params.expert_numel * (shape.experts - shape.top_k) // shape.experts
    router = moe_router_class(model)
    layers = sum(isinstance(m, router) for m in model.modules()) if router else shape.layers
    key_bytes = layers * shape.top_k * routes_dtype(shape.experts).itemsize
    return {"num_active_params": params.num_params - idle, "routing_key_bytes_per_token": key_bytes}
