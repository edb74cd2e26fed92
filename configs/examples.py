"""Typed configs of the example trainings (``examples/grpo_lora.py``, ``examples/ppo_lora.py``).

One dataclass per section, nested into :class:`GRPOExampleConfig` / :class:`PPOExampleConfig`;
the YAML files beside this module hold the defaults a run starts from, and ``key.sub=value``
overrides on the command line change them (:func:`microrl.configs.loader.load_config`). Every
section validates its own ranges in ``__post_init__`` with a message that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microrl.configs.engine import ActorConfig, CriticConfig, LoraConfig, OptimConfig
from microrl.losses.config import PolicyLossConfig

__all__ = [
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


@dataclass
class WarmStartConfig:
    """Supervised warm start of a freshly built base model (only when ``model.path`` is empty).

    It trains until the greedy accuracy on 200 training prompts (the held-out ones are kept for
    RL) reaches ``target_accuracy`` or ``max_steps`` pass: a partly trained base leaves RL
    visible room to improve.
    """

    max_steps: int = 600
    batch_size: int = 64
    lr: float = 3e-3
    target_accuracy: float = 0.3
    eval_every: int = 50

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
    the size fields are ignored. Otherwise a tiny Qwen2 is built, warm-started and saved there.
    """

    path: str = "outputs/base/qwen2-adder"
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 32
    seed: int = 0
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    def __post_init__(self) -> None:
        _check(bool(self.path), "model.path", "a non-empty path", self.path)
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "max_positions"):
            _check(getattr(self, key) >= 1, f"model.{key}", ">= 1", getattr(self, key))
        _check(
            self.hidden_size % self.num_heads == 0,
            "model.hidden_size",
            f"a multiple of model.num_heads={self.num_heads}",
            self.hidden_size,
        )


@dataclass
class TaskConfig:
    """Addition ``a+b=`` with ``0 <= a, b <= max_operand``; ``eval_size`` pairs are held out."""

    max_operand: int = 99
    eval_size: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        _check(1 <= self.max_operand <= 9999, "task.max_operand", "in [1, 9999]", self.max_operand)
        _check(
            1 <= self.eval_size < (self.max_operand + 1) ** 2,
            "task.eval_size",
            f"in [1, {(self.max_operand + 1) ** 2 - 1}]",
            self.eval_size,
        )


@dataclass
class RolloutConfig:
    """Sampling. The temperature is ``actor.temperature``: the loss must score the same policy
    that sampled, so there is deliberately no second temperature here."""

    prompts_per_step: int = 32  # across all ranks
    group_size: int = 8  # responses per prompt
    max_new_tokens: int = 4

    def __post_init__(self) -> None:
        _check(
            self.prompts_per_step >= 1, "rollout.prompts_per_step", ">= 1", self.prompts_per_step
        )
        _check(self.group_size >= 1, "rollout.group_size", ">= 1", self.group_size)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)


@dataclass
class LoopConfig:
    """The outer loop: ``steps`` rollouts, each followed by ``ppo_epochs`` passes over it in
    mini-batches of ``mini_batch_size`` sequences (one optimizer step each)."""

    steps: int = 300
    ppo_epochs: int = 2
    mini_batch_size: int = 128  # sequences per optimizer step, across all ranks
    eval_every: int = 25  # greedy accuracy on the held-out prompts every N steps (and at the end)
    seed: int = 0
    # CPU threads per process; 0 keeps torch's default. The tiny model's matrices are too small
    # to gain from intra-op threads, and extra threads spin badly on a busy or small CPU.
    num_threads: int = 1

    def __post_init__(self) -> None:
        for key in ("steps", "ppo_epochs", "mini_batch_size", "eval_every"):
            _check(getattr(self, key) >= 1, f"train.{key}", ">= 1", getattr(self, key))
        _check(self.num_threads >= 0, "train.num_threads", ">= 0", self.num_threads)


@dataclass
class OutputConfig:
    dir: str = "outputs/grpo_lora"
    save_every: int = 0  # checkpoint every N steps; 0: only at the end and on Ctrl-C
    tensorboard: bool = True
    plot: bool = True
    progress: bool = True  # the tqdm bar (off in tests / CI logs)

    def __post_init__(self) -> None:
        _check(bool(self.dir), "output.dir", "a non-empty path", self.dir)
        _check(self.save_every >= 0, "output.save_every", ">= 0", self.save_every)


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

    gamma: float = 1.0
    lam: float = 0.95

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
