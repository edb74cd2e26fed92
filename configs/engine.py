"""Typed engine configuration: ``ActorConfig`` and ``CriticConfig`` (docs/engine.md).

Every field has a default; ``__post_init__`` validates ranges so a bad value fails at construction
with a message that names the key, whether it came from Python, YAML or a command-line override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from microrl.configs.fields import config_field, require_bool
from microrl.losses.aggregation import AggMode
from microrl.losses.config import PolicyLossConfig, RouterLossConfig

__all__ = [
    "BASE_DTYPES",
    "ActorConfig",
    "CriticConfig",
    "EngineConfig",
    "LoraConfig",
    "OptimConfig",
]


# Rows per micro-batch when neither micro-batching mode is configured.
DEFAULT_MICRO_BATCH_SIZE = 4

# EngineConfig.base_dtype -> the dtype the model's frozen base weights are stored in.
BASE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Schedule(str, Enum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


@dataclass
class OptimConfig:
    name: str = config_field("adamw", "optimizer: adamw or sgd")
    lr: float = config_field(1e-5, "learning rate (after warm-up)")
    betas: tuple[float, float] = config_field((0.9, 0.999), "AdamW betas: two floats in [0, 1)")
    eps: float = config_field(1e-8, "AdamW epsilon")
    weight_decay: float = config_field(0.0, "decoupled weight decay")
    grad_clip: float | None = config_field(1.0, "max global gradient norm (null: no clipping)")
    warmup_steps: int = config_field(0, "optimizer steps of linear learning-rate warm-up")
    schedule: Schedule = config_field(
        Schedule.CONSTANT, "learning-rate schedule after warm-up: constant, cosine or linear"
    )
    total_steps: int | None = config_field(None, "optimizer steps the cosine/linear decay spans")
    min_lr_ratio: float = config_field(0.0, "floor of the decay, as a fraction of lr")
    # FSDP2's CPUOffloadPolicy (docs/distributed.md): parameter shards, gradients and optimizer
    # state in host memory, the optimizer step on the CPU. In one process the engine shards with
    # FSDP2 over a single rank for it.
    cpu_offload: bool = config_field(
        False, "parameters, gradients and optimizer state in host memory (FSDP2 CPU offload)"
    )

    def __post_init__(self) -> None:
        self.schedule = Schedule(self.schedule)
        self.betas = tuple(self.betas)
        if self.name not in ("adamw", "sgd"):
            raise ValueError(f"optim.name must be 'adamw' or 'sgd', got {self.name!r}")
        if not self.lr >= 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two floats in [0, 1), got {list(self.betas)}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"optim.grad_clip must be > 0 or None, got {self.grad_clip}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule is not Schedule.CONSTANT and not (self.total_steps or 0) > 0:
            raise ValueError(f"optim.total_steps must be > 0 for schedule {self.schedule.value!r}")
        require_bool(self.cpu_offload, "optim.cpu_offload")


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the causal LM; ``rank=0`` trains every parameter instead.

    ``target_modules``: which layers get an adapter.

    * ``None`` (default): picked for the architecture -- every linear layer of the model
      (``nn.Linear`` and GPT-2's ``Conv1D``) except the output head, i.e. peft's ``"all-linear"``.
      A fixed list of names would fit one family only (``q_proj``... matches nothing in GPT-2).
      The lm head stays a plain ``nn.Linear``, which the fused log-prob kernel needs.
    * a string, passed to peft as is: ``"all-linear"`` or a regular expression that must match
      whole module names.
    * a list of names: a module is adapted when its name is one of them or ends with
      ``".<name>"``; each name must match at least one module of the model.

    ``target_parameters``: parameters adapted directly (peft's ``target_parameters``), e.g. a
    mixture-of-experts model's fused 3-D expert weights ``["experts.gate_up_proj",
    "experts.down_proj"]``; a name matches a parameter whose full name is it or ends with
    ``".<name>"``, and each must match one. None: only what peft itself adds (for Qwen2/Qwen3-MoE
    and Mixtral, ``"all-linear"`` also adapts the experts and the router, as it did when they were
    linear layers). Adapted parameters need ``dropout=0`` (docs/engine.md#mixture-of-experts).

    ``dropout`` is the adapters' own dropout: an explicit choice, so ``disable_dropout`` of the
    engine leaves it alone (with ``dropout > 0`` the training forward is stochastic again).
    """

    rank: int = config_field(0, "LoRA rank (0: train every parameter)")
    alpha: float = config_field(16.0, "LoRA scaling numerator (scale = alpha / rank)")
    dropout: float = config_field(0.0, "dropout on the LoRA adapters' input")
    # str | list[str] | None; typed Any because OmegaConf < 2.4 rejects a union with a list.
    target_modules: Any = config_field(
        None, "layers that get an adapter (null: every linear layer but the head)"
    )
    # list[str] | None, typed Any for OmegaConf (as target_modules).
    target_parameters: Any = config_field(
        None, "parameters adapted directly, e.g. MoE experts' fused weights (null: none)"
    )

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        targets = self.target_modules
        if isinstance(targets, (list, tuple)):
            if not all(isinstance(t, str) and t for t in targets):
                raise ValueError(
                    f"lora.target_modules must hold non-empty module names, got {targets!r}"
                )
            self.target_modules = list(targets)
            if self.rank and not self.target_modules:
                raise ValueError(
                    "lora.target_modules must name at least one module when lora.rank > 0 "
                    "(or be None: every linear layer but the output head)"
                )
        elif isinstance(targets, str):
            if not targets:
                raise ValueError("lora.target_modules must not be an empty string")
        elif targets is not None:
            # ValueError, not TypeError: OmegaConf would bury a TypeError under its own message.
            raise ValueError(
                "lora.target_modules must be None (every linear layer but the output head), "
                f"a string such as 'all-linear', or a list of module names; got {targets!r}"
            )
        params = self.target_parameters
        if params is not None:
            ok = isinstance(params, (list, tuple)) and all(isinstance(t, str) and t for t in params)
            if not ok or not params:
                raise ValueError(
                    "lora.target_parameters must be None or a non-empty list of parameter names "
                    f"(e.g. ['experts.gate_up_proj', 'experts.down_proj']), got {params!r}"
                )
            self.target_parameters = list(params)


@dataclass
class EngineConfig:
    """What every engine role shares: batching, numerics, memory, optimisation."""

    # Micro-batching: a fixed number of rows, or a strict token budget (set one; with neither,
    # micro_batch_size defaults to DEFAULT_MICRO_BATCH_SIZE).
    micro_batch_size: int | None = config_field(
        None, "rows per forward/backward pass (exclusive with the token budget)"
    )
    max_tokens_per_micro_batch: int | None = config_field(
        None, "token budget per micro-batch instead of a row count"
    )
    loss_agg_mode: AggMode = config_field(
        AggMode.TOKEN_MEAN,
        "loss normalisation (token-mean, seq-mean-token-mean, ...; docs/losses.md)",
    )
    seq_len_norm: float | None = config_field(None, "the constant L of seq-mean-token-sum-norm")
    use_fused_kernel: bool = config_field(
        True, "fused chunked lm-head log-probs (false: the eager fp32 head)"
    )
    kernel_chunk_size: int | None = config_field(
        None, "rows per fused-kernel chunk (null: the kernel picks)"
    )
    gradient_checkpointing: bool = config_field(
        False, "recompute decoder activations in backward (less memory)"
    )
    pack_sequences: bool = config_field(
        False, "run each micro-batch as one packed row without padding"
    )
    # Saved activations to host memory between forward and backward (engine/offload.py; with
    # gradient checkpointing only the layer boundaries). Training passes only.
    activation_offload: bool = config_field(
        False, "tensors saved for backward go to host memory until the backward needs them"
    )
    # Audited after backward: "warn" logs a warning, "error" raises, True means "warn".
    check_grad_flow: bool | str = config_field(
        False, "name trainable parameters left without a gradient: false, warn, error"
    )
    dtype: str = config_field(
        "auto", "auto (float32 on CPU, bf16 autocast on CUDA), float32 or bfloat16"
    )
    # Storage, not compute: a 16-bit base halves the frozen weights' bytes (LoRA only: a full
    # fine-tune needs fp32 master weights). Adapters, heads and optimizer state stay float32.
    base_dtype: str = config_field(
        "float32", "dtype of the frozen base weights under LoRA: float32, bfloat16 or float16"
    )
    # A device that is not available here fails at engine construction.
    device: str = config_field(
        "auto", "auto (CUDA if present, else CPU) or a torch device such as cuda:1"
    )
    seed: int = config_field(0, "seed of the engine's own initialisation (the critic's value head)")
    # Zero every dropout probability of the model (nn.Dropout modules and the float rates that
    # attention implementations read, e.g. Qwen2's attention_dropout) when the engine is built.
    # RL ratios exp(logp - old_logp) need the training forward to be the same function as the
    # rollout / old-log-prob forward (eval mode): with dropout the first on-policy ratio is not 1,
    # and clipping, KL and importance weights measure dropout noise. TRL and verl do the same.
    # LoRA's own lora.dropout is an explicit choice and is kept.
    disable_dropout: bool = config_field(
        True, "zero the model's dropout so training passes match the rollout"
    )
    # Under torchrun it must divide the number of processes; the rest is data parallelism.
    tensor_parallel_size: int = config_field(
        1, "ranks per tensor-parallel group (1: none; docs/engine.md)"
    )
    # Ulysses: the ranks of a group split every micro-batch's tokens (docs/distributed.md). Under
    # torchrun it must divide the number of processes; the rest is data parallelism.
    sequence_parallel_size: int = config_field(
        1, "ranks that split each micro-batch's tokens (Ulysses; 1: none; docs/distributed.md)"
    )
    # Vision-language models (docs/engine.md#images): true keeps the vision tower (encoder and
    # merger) frozen and LoRA on the language model; false trains it (its weights in a full
    # fine-tune, LoRA adapters on its linear layers under LoRA). The grad-flow audit checks it.
    freeze_vision: bool = config_field(
        True, "keep a vision-language model's vision tower frozen (false: it trains too)"
    )
    # Mixture-of-experts models (docs/engine.md#mixture-of-experts): a batch that carries the
    # per-token `routed_experts` key is replayed (each token through its recorded experts, gate
    # weights from the trainer's router); false only measures the routing agreement.
    routing_replay: bool = config_field(
        True, "route MoE tokens through the batch's routed_experts (false: only measure them)"
    )
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    router_loss: RouterLossConfig = field(default_factory=RouterLossConfig)

    def __post_init__(self) -> None:
        self.loss_agg_mode = AggMode.parse(self.loss_agg_mode)
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError(
                "set either micro_batch_size or max_tokens_per_micro_batch, not both "
                f"(got {self.micro_batch_size} and {self.max_tokens_per_micro_batch})"
            )
        if self.micro_batch_size is None and self.max_tokens_per_micro_batch is None:
            self.micro_batch_size = DEFAULT_MICRO_BATCH_SIZE
        for name in ("micro_batch_size", "max_tokens_per_micro_batch", "kernel_chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if (
            self.loss_agg_mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM
            and not (self.seq_len_norm or 0) > 0
        ):
            raise ValueError(
                "seq_len_norm must be > 0 when loss_agg_mode is 'seq-mean-token-sum-norm'"
            )
        if self.check_grad_flow is True:
            self.check_grad_flow = "warn"
        if self.check_grad_flow not in (False, "warn", "error"):
            raise ValueError(
                f"check_grad_flow must be False, True, 'warn' or 'error', got {self.check_grad_flow!r}"
            )
        if isinstance(self.tensor_parallel_size, bool) or not (
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1
        ):
            raise ValueError(
                f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}"
            )
        if isinstance(self.sequence_parallel_size, bool) or not (
            isinstance(self.sequence_parallel_size, int) and self.sequence_parallel_size >= 1
        ):
            raise ValueError(
                f"sequence_parallel_size must be an int >= 1, got {self.sequence_parallel_size!r}"
            )
        if self.sequence_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} and "
                f"tensor_parallel_size={self.tensor_parallel_size} cannot be combined yet: "
                "set one of them to 1"
            )
        require_bool(self.freeze_vision, "freeze_vision")
        require_bool(self.routing_replay, "routing_replay")
        require_bool(self.activation_offload, "activation_offload")
        if self.optim.cpu_offload and self.tensor_parallel_size > 1:
            raise ValueError(
                "optim.cpu_offload and tensor_parallel_size > 1 cannot be combined (CPU offload "
                "is FSDP2's, over data-parallel ranks only): set optim.cpu_offload=false or "
                f"tensor_parallel_size=1 (got {self.tensor_parallel_size})"
            )
        if self.tensor_parallel_size > 1 and self.lora.rank and self.lora.dropout > 0:
            raise ValueError(
                "lora.dropout must be 0 when tensor_parallel_size > 1 (each rank of a "
                f"tensor-parallel group would draw its own dropout mask), got {self.lora.dropout}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"base_dtype must be one of {', '.join(BASE_DTYPES)}, got {self.base_dtype!r}"
            )
        if self.base_dtype != "float32" and not self.lora.rank:
            raise ValueError(
                f"base_dtype={self.base_dtype!r} needs LoRA (lora.rank > 0): a full fine-tune "
                "trains the base weights, which need float32 master weights (AdamW updates "
                "below a 16-bit weight's resolution would be lost); use base_dtype='float32'"
            )
        if self.device != "auto":
            try:
                if not isinstance(self.device, str):
                    raise TypeError
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    "device must be 'auto' or a torch device string such as 'cpu', 'cuda' or "
                    f"'cuda:1', got {self.device!r}"
                ) from None


@dataclass
class ActorConfig(EngineConfig):
    temperature: float = config_field(1.0, "sampling temperature, also applied in the loss")
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # Per-token entropy in training passes too (``output["entropy"]`` for a custom loss_fn, with
    # its gradient; the built-in loss then also reports the ``entropy`` metric). Off, a training
    # pass computes it only when policy_loss.entropy_coef > 0, as it adds work over the vocabulary
    # for every token, forward and backward. Inference (infer_batch) always returns it.
    compute_entropy: bool = config_field(
        False, "per-token entropy in training passes too (costs a vocab pass)"
    )
    # Fused policy-loss path (docs/engine.md): with the fused head, a training pass of the
    # built-in loss (loss_fn=None) or of engine.sft_loss runs the loss inside the head and forms
    # the head's gradients in forward (no logits recompute in backward); custom losses and
    # forward-only passes use the kernel + loss path. Same loss, metrics and gradients to fp32
    # rounding; False always uses the kernel + loss path.
    fuse_loss: bool = config_field(
        True, "loss inside the fused head, gradients formed in forward (faster)"
    )
    # DAPO (Yu et al. 2025): a response cut at max_new_tokens (no <eos>) is not trained on. The
    # engine zeroes the loss_mask of the rows the batch's per-row `truncated` key marks before
    # it counts the mini-batch's denominators, so every loss path sees only the kept tokens and
    # the normalisation is exact under any split
    # (docs/losses.md#truncated-responses-mask_truncated).
    mask_truncated: bool = config_field(
        False,
        "no loss on responses cut at max_new_tokens (the batch's truncated rows; DAPO)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.temperature > 0 and self.temperature != float("inf")):
            raise ValueError(f"temperature must be a finite float > 0, got {self.temperature}")
        require_bool(self.mask_truncated, "mask_truncated")


@dataclass
class CriticConfig(EngineConfig):
    cliprange_value: float | None = config_field(
        0.2, "value clipping around the old values (null: none)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cliprange_value is not None and not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0 or None, got {self.cliprange_value}")
