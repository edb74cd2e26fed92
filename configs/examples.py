"""Typed configs of the example trainings (``examples/grpo_lora.py``, ``examples/ppo_lora.py``).

One dataclass per section, nested into :class:`GRPOExampleConfig` / :class:`PPOExampleConfig`;
the YAML files beside this module hold the defaults a run starts from, and ``key.sub=value``
overrides on the command line change them (:func:`microrl.configs.loader.load_config`). Every
section validates its own ranges in ``__post_init__`` with a message that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from microrl.configs.engine import (
    ActorConfig,
    CriticConfig,
    EngineConfig,
    LoraConfig,
    OptimConfig,
)
from microrl.configs.rollout import ROLLOUT_BACKENDS, VLLMConfig
from microrl.losses.config import PolicyLossConfig

__all__ = [
    "EXTERNAL_HELP",
    "TASK_NAMES",
    "GAEConfig",
    "GRPOExampleConfig",
    "LoopConfig",
    "ModelConfig",
    "OutputConfig",
    "PPOExampleConfig",
    "RolloutConfig",
    "TaskConfig",
    "WarmStartConfig",
]


def _check(condition: bool, key: str, rule: str, value: object) -> None:
    if not condition:
        raise ValueError(f"{key} must be {rule}, got {value!r}")


def _key(default: Any, help: str) -> Any:
    """A config field with its one-line ``--help`` description (``metadata["help"]``)."""
    return field(default=default, metadata={"help": help})


@dataclass
class WarmStartConfig:
    """Supervised warm start of a freshly built base model (only when ``model.path`` is empty).

    It trains until the greedy accuracy on 200 training prompts (the held-out ones are kept for
    RL) reaches ``target_accuracy`` or ``max_steps`` pass: a partly trained base leaves RL
    visible room to improve.
    """

    max_steps: int = _key(600, "most supervised warm-start steps")
    batch_size: int = _key(64, "warm-start prompts per step, across all processes")
    lr: float = _key(3e-3, "warm-start learning rate (AdamW, full fine-tune)")
    target_accuracy: float = _key(0.3, "stop warm-starting at this greedy accuracy")
    eval_every: int = _key(50, "measure the warm-start accuracy every N steps")

    def __post_init__(self) -> None:
        for key in ("max_steps", "batch_size", "eval_every"):
            _check(getattr(self, key) >= 1, f"model.warm_start.{key}", ">= 1", getattr(self, key))
        _check(self.lr > 0, "model.warm_start.lr", "> 0", self.lr)
        _check(
            0 < self.target_accuracy <= 1,
            "model.warm_start.target_accuracy",
            "in (0, 1]",
            self.target_accuracy,
        )


@dataclass
class ModelConfig:
    """Where the base model lives and, when it must be built, its size.

    ``path`` holding a transformers checkpoint (``config.json`` + tokenizer) is loaded as is, and
    the size fields are ignored. Otherwise a tiny Llama-architecture model is built, warm-started and
    saved there (:mod:`microrl.tasks.toy_model`).
    """

    path: str = _key(
        "outputs/base/tiny-adder", "base model: loaded, or built, warm-started and saved here"
    )
    hidden_size: int = _key(64, "width of a newly built base model")
    intermediate_size: int = _key(256, "MLP width of a newly built base model")
    num_layers: int = _key(2, "decoder layers of a newly built base model")
    num_heads: int = _key(4, "attention heads of a newly built base model")
    head_dim: int = _key(
        32, "width of each head (vLLM's CPU attention needs >= 32); 0: hidden_size / num_heads"
    )
    max_positions: int = _key(32, "longest sequence a newly built base model handles")
    seed: int = _key(0, "seed of a newly built base model's weights and of its warm start")
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    def __post_init__(self) -> None:
        _check(bool(self.path), "model.path", "a non-empty path", self.path)
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "max_positions"):
            _check(getattr(self, key) >= 1, f"model.{key}", ">= 1", getattr(self, key))
        _check(self.head_dim >= 0, "model.head_dim", ">= 0", self.head_dim)
        _check(
            self.head_dim > 0 or self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            f"a multiple of model.num_heads={self.num_heads} (or set model.head_dim)",
            self.hidden_size,
        )


# The tasks a recipe can train on (microrl.tasks.make_task builds them; docs/tasks.md).
TASK_NAMES = ("addition", "word_problems", "dataset")


@dataclass
class TaskConfig:
    """The prompts, held-out prompts and reward of the run (docs/tasks.md).

    ``addition`` (``a+b=`` with ``0 <= a, b <= max_operand``) and ``word_problems`` are generated;
    ``dataset`` reads ``train_file`` (JSONL/Parquet, ``prompt_field`` and ``answer_field`` per
    row) and scores with the ``rewards`` functions (``module:function`` import paths, summed with
    ``reward_weights``). ``eval_size`` prompts are held out and never trained on.
    """

    name: str = _key("addition", "the task: addition, word_problems or dataset (docs/tasks.md)")
    max_operand: int = _key(
        99, "built-in tasks' largest number: addition a+b= with 0 <= a, b <= it; word problems"
    )
    eval_size: int = _key(
        500, "held-out prompts for the greedy accuracy, never trained on (dataset: rows)"
    )
    seed: int = _key(0, "seed of the held-out split (and of the word problems' names and items)")
    train_file: str | None = _key(None, "dataset: the training prompts, a .jsonl or .parquet file")
    eval_file: str | None = _key(
        None, "dataset: held-out prompts file (null: eval_size rows held out of train_file)"
    )
    prompt_field: str = _key("prompt", "dataset: the field of a row holding the prompt")
    answer_field: str = _key("answer", "dataset: the field holding the reference answer")
    chat_template: bool = _key(False, "dataset: render prompts with the tokenizer's chat template")
    rewards: list[str] = field(
        default_factory=list,
        metadata={
            "help": "reward functions [module:function, file.py:function] (dataset: needed; "
            "built-in tasks: replace their reward)"
        },
    )
    reward_weights: list[float] = field(
        default_factory=list,
        metadata={"help": "a weight per entry of task.rewards (empty: 1.0 each)"},
    )
    solved_threshold: float = _key(
        1.0, "with task.rewards: a held-out response is solved at a reward >= this"
    )

    def __post_init__(self) -> None:
        _check(self.name in TASK_NAMES, "task.name", f"one of {', '.join(TASK_NAMES)}", self.name)
        _check(1 <= self.max_operand <= 9999, "task.max_operand", "in [1, 9999]", self.max_operand)
        _check(self.eval_size >= 1, "task.eval_size", ">= 1", self.eval_size)
        if self.name == "addition":
            _check(
                self.eval_size < (self.max_operand + 1) ** 2,
                "task.eval_size",
                f"in [1, {(self.max_operand + 1) ** 2 - 1}]",
                self.eval_size,
            )
        is_dataset = self.name == "dataset"
        for key in ("train_file", "eval_file"):
            _check(
                is_dataset or getattr(self, key) is None,
                f"task.{key}",
                "null unless task.name=dataset (set task.name=dataset to train on a file)",
                getattr(self, key),
            )
        _check(
            not is_dataset or bool(self.train_file),
            "task.train_file",
            "a .jsonl or .parquet file of prompts for task.name=dataset",
            self.train_file,
        )
        _check(
            not is_dataset or bool(self.rewards),
            "task.rewards",
            "a non-empty list of reward functions for task.name=dataset, e.g. "
            "[my_reward:score] or [microrl.tasks.rewards:exact_match]",
            self.rewards,
        )
        _check(
            not self.reward_weights or len(self.reward_weights) == len(self.rewards),
            "task.reward_weights",
            f"empty or one weight per entry of task.rewards ({len(self.rewards)})",
            self.reward_weights,
        )


@dataclass
class RolloutConfig:
    """Sampling. The temperature is ``actor.temperature``: the loss must score the same policy
    that sampled, so there is deliberately no second temperature here."""

    prompts_per_step: int = _key(32, "prompts sampled per step, across all processes")
    group_size: int = _key(8, "responses sampled per prompt (a GRPO group)")
    max_new_tokens: int = _key(4, "longest response, in tokens (<eos> included)")
    backend: str = _key("hf", "hf (transformers generate) or vllm (docs/rollouts.md)")
    sync_every: int = _key(1, "vllm: load the trained weights into vLLM every N steps")
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def __post_init__(self) -> None:
        _check(
            self.backend in ROLLOUT_BACKENDS,
            "rollout.backend",
            f"one of {', '.join(ROLLOUT_BACKENDS)}",
            self.backend,
        )
        _check(self.sync_every >= 1, "rollout.sync_every", ">= 1", self.sync_every)
        _check(
            self.prompts_per_step >= 1, "rollout.prompts_per_step", ">= 1", self.prompts_per_step
        )
        _check(self.group_size >= 1, "rollout.group_size", ">= 1", self.group_size)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)


@dataclass
class LoopConfig:
    """The outer loop: ``steps`` rollouts, each followed by ``ppo_epochs`` passes over it in
    mini-batches of ``mini_batch_size`` sequences (one optimizer step each)."""

    steps: int = _key(300, "RL steps (one rollout and its updates each); the last step run")
    ppo_epochs: int = _key(2, "passes over each rollout")
    mini_batch_size: int = _key(128, "sequences per optimizer step, across all processes")
    eval_every: int = _key(25, "held-out greedy accuracy every N steps (and at the last step)")
    seed: int = _key(0, "seed of the LoRA initialisation, prompt order and sampling")
    # The tiny model's matrices are too small to gain from intra-op threads, and extra threads
    # spin badly on a busy or small CPU.
    num_threads: int = _key(1, "CPU threads per process (0: torch's default)")

    def __post_init__(self) -> None:
        for key in ("steps", "ppo_epochs", "mini_batch_size", "eval_every"):
            _check(getattr(self, key) >= 1, f"train.{key}", ">= 1", getattr(self, key))
        _check(self.num_threads >= 0, "train.num_threads", ">= 0", self.num_threads)


@dataclass
class OutputConfig:
    """What a run writes into ``dir`` (metrics, TensorBoard, curves, adapter, checkpoint) and
    what it prints while it trains."""

    dir: str = _key(
        "outputs/grpo_lora",
        "where the run writes (holding a checkpoint: --resume or --overwrite)",
    )
    save_every: int = _key(0, "checkpoint every N steps (0: only at the end and on Ctrl-C)")
    tensorboard: bool = _key(True, "write TensorBoard scalars to output.dir/tensorboard")
    plot: bool = _key(True, "draw output.dir/curves.png at the end")
    progress: bool = _key(True, "a live progress bar when stdout is a terminal")
    log_every: int = _key(10, "without the bar: a plain line every N steps (0: none)")

    def __post_init__(self) -> None:
        _check(bool(self.dir), "output.dir", "a non-empty path", self.dir)
        _check(self.save_every >= 0, "output.save_every", ">= 0", self.save_every)
        _check(self.log_every >= 0, "output.log_every", ">= 0", self.log_every)


def _grpo_actor() -> ActorConfig:
    return ActorConfig(
        micro_batch_size=32,
        temperature=1.0,
        optim=OptimConfig(lr=1e-3, grad_clip=1.0),
        lora=LoraConfig(rank=8, alpha=16.0),
        policy_loss=PolicyLossConfig(name="grpo", kl_coef=0.0),
    )


def _check_lora_batches(actor: ActorConfig, rollout: RolloutConfig, train: LoopConfig) -> None:
    _check(
        actor.lora.rank >= 1,
        "actor.lora.rank",
        ">= 1 (the reference policy is the base model with the adapter disabled)",
        actor.lora.rank,
    )
    rollout_size = rollout.prompts_per_step * rollout.group_size
    _check(
        rollout_size % train.mini_batch_size == 0,
        "train.mini_batch_size",
        f"a divisor of rollout.prompts_per_step * rollout.group_size = {rollout_size}",
        train.mini_batch_size,
    )


@dataclass
class GRPOExampleConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=_grpo_actor)
    train: LoopConfig = field(default_factory=LoopConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        _check(
            self.rollout.group_size >= 2,
            "rollout.group_size",
            ">= 2 for GRPO",
            self.rollout.group_size,
        )
        _check_lora_batches(self.actor, self.rollout, self.train)


@dataclass
class GAEConfig:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens."""

    gamma: float = _key(1.0, "discount per token (1: the final reward counts fully)")
    lam: float = _key(0.95, "GAE lambda: bias (0) vs variance (1) of the advantages")

    def __post_init__(self) -> None:
        _check(0 <= self.gamma <= 1, "gae.gamma", "in [0, 1]", self.gamma)
        _check(0 <= self.lam <= 1, "gae.lam", "in [0, 1]", self.lam)


def _ppo_actor() -> ActorConfig:
    return ActorConfig(
        micro_batch_size=32,
        temperature=1.0,
        optim=OptimConfig(lr=2e-3, grad_clip=1.0),
        lora=LoraConfig(rank=8, alpha=16.0),
        policy_loss=PolicyLossConfig(name="ppo", kl_coef=0.01),
    )


def _ppo_critic() -> CriticConfig:
    return CriticConfig(
        micro_batch_size=32,
        optim=OptimConfig(lr=3e-3, grad_clip=1.0),
        lora=LoraConfig(rank=8, alpha=16.0),
    )


def _ppo_rollout() -> RolloutConfig:
    return RolloutConfig(prompts_per_step=64, group_size=2)


def _ppo_train() -> LoopConfig:
    return LoopConfig(mini_batch_size=64)


def _ppo_output() -> OutputConfig:
    return OutputConfig(dir="outputs/ppo_lora")


@dataclass
class PPOExampleConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=_ppo_rollout)
    actor: ActorConfig = field(default_factory=_ppo_actor)
    critic: CriticConfig = field(default_factory=_ppo_critic)
    gae: GAEConfig = field(default_factory=GAEConfig)
    train: LoopConfig = field(default_factory=_ppo_train)
    output: OutputConfig = field(default_factory=_ppo_output)

    def __post_init__(self) -> None:
        _check_lora_batches(self.actor, self.rollout, self.train)


# One-line --help descriptions of the engine and loss sections, whose dataclasses live outside
# this module (microrl.configs.engine, microrl.losses.config; docs/engine.md, docs/losses.md).
# Looked up along the class's MRO, after a field's own ``metadata["help"]``; a test checks that
# every key of both examples has one.
EXTERNAL_HELP: dict[type, dict[str, str]] = {
    EngineConfig: {
        "micro_batch_size": "rows per forward/backward pass (exclusive with the token budget)",
        "max_tokens_per_micro_batch": "token budget per micro-batch instead of a row count",
        "loss_agg_mode": "loss normalisation (token-mean, seq-mean-token-mean, ...; docs/losses.md)",
        "seq_len_norm": "the constant L of seq-mean-token-sum-norm",
        "use_fused_kernel": "fused chunked lm-head log-probs (false: the eager fp32 head)",
        "kernel_chunk_size": "rows per fused-kernel chunk (null: the kernel picks)",
        "gradient_checkpointing": "recompute decoder activations in backward (less memory)",
        "pack_sequences": "run each micro-batch as one packed row without padding",
        "check_grad_flow": "name trainable parameters left without a gradient: false, warn, error",
        "dtype": "auto (float32 on CPU, bf16 autocast on CUDA), float32 or bfloat16",
        "device": "auto (CUDA if present, else CPU) or a torch device such as cuda:1",
        "seed": "seed of the engine's own initialisation (the critic's value head)",
        "disable_dropout": "zero the model's dropout so training passes match the rollout",
        "tensor_parallel_size": "ranks per tensor-parallel group (1: none; docs/engine.md)",
    },
    ActorConfig: {
        "temperature": "sampling temperature, also applied in the loss",
        "compute_entropy": "per-token entropy in training passes too (costs a vocab pass)",
    },
    CriticConfig: {
        "cliprange_value": "value clipping around the old values (null: none)",
    },
    OptimConfig: {
        "name": "optimizer: adamw or sgd",
        "lr": "learning rate (after warm-up)",
        "betas": "AdamW betas",
        "eps": "AdamW epsilon",
        "weight_decay": "decoupled weight decay",
        "grad_clip": "max global gradient norm (null: no clipping)",
        "warmup_steps": "optimizer steps of linear learning-rate warm-up",
        "schedule": "learning-rate schedule after warm-up: constant, cosine or linear",
        "total_steps": "optimizer steps the cosine/linear decay spans",
        "min_lr_ratio": "floor of the decay, as a fraction of lr",
    },
    LoraConfig: {
        "rank": "LoRA rank (0: train every parameter)",
        "alpha": "LoRA scaling numerator (scale = alpha / rank)",
        "dropout": "dropout on the LoRA adapters' input",
        "target_modules": "layers that get an adapter (null: every linear layer but the head)",
    },
    PolicyLossConfig: {
        "name": "surrogate: ppo, grpo, gspo, cispo or reinforce",
        "clip_ratio_low": "ratio clip below: 1 - clip_ratio_low",
        "clip_ratio_high": "ratio clip above: 1 + clip_ratio_high",
        "clip_ratio_c": "dual-clip bound for negative advantages (null: off)",
        "kl_coef": "weight of the KL penalty to the reference (adapter-off) policy",
        "kl_estimator": "KL estimator: k1, k2, k3, k1+ or k3+",
        "entropy_coef": "weight of the entropy bonus",
        "tis_cap": "truncated importance-sampling cap (null: off)",
    },
}
