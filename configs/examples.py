"""Typed configs of the example trainings (``examples/grpo_lora.py``, ``examples/ppo_lora.py``).

Each is one top-level dataclass that nests the run's sections (:mod:`microrl.configs.run`) with
its engines' configs (:mod:`microrl.configs.engine`); what the sections must agree on, and what
each recipe refuses, are the rows of :mod:`microrl.configs.refusals`. The YAML files beside this
module hold the defaults a run starts from, and ``key.sub=value`` overrides on the command line
change them (:func:`microrl.configs.loader.load_config`). The library never imports this module
(tests/test_imports.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from microrl.configs.engine import ActorConfig, CriticConfig, LoraConfig, OptimConfig
from microrl.configs.fields import config_field, require
from microrl.configs.refusals import check_refusals
from microrl.configs.run import (
    LoopConfig,
    ModelConfig,
    OutputConfig,
    RolloutConfig,
    TaskConfig,
)
from microrl.configs.teacher import TeacherConfig
from microrl.losses.config import PolicyLossConfig

__all__ = ["GAEConfig", "GRPOExampleConfig", "PPOExampleConfig"]


def _lora_actor(surrogate: str, kl_coef: float) -> ActorConfig:
    """Both examples' actor but for its policy loss."""
    return ActorConfig(
        micro_batch_size=128,
        temperature=1.0,
        optim=OptimConfig(lr=2e-3, grad_clip=1.0),
        lora=LoraConfig(rank=8, alpha=16.0),
        policy_loss=PolicyLossConfig(name=surrogate, kl_coef=kl_coef),
    )


def _grpo_rollout() -> RolloutConfig:
    # max_episode_tokens: the toy model's 32 positions (multi-turn tasks)
    return RolloutConfig(prompts_per_step=128, group_size=8, max_episode_tokens=24)


def _grpo_train() -> LoopConfig:
    return LoopConfig(ppo_epochs=1, mini_batch_size=256)


@dataclass
class GRPOExampleConfig:
    """``examples/grpo_lora.py`` (defaults: ``configs/grpo_lora.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=_grpo_rollout)
    actor: ActorConfig = field(default_factory=partial(_lora_actor, "grpo", kl_coef=0.0))
    train: LoopConfig = field(default_factory=_grpo_train)
    output: OutputConfig = field(default_factory=OutputConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)

    def __post_init__(self) -> None:
        check_refusals("recipe", self, recipe="grpo")  # docs/recipes.md#what-composes


@dataclass
class GAEConfig:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens."""

    gamma: float = config_field(1.0, "discount per token (1: the final reward counts fully)")
    lam: float = config_field(0.95, "GAE lambda: bias (0) vs variance (1) of the advantages")

    def __post_init__(self) -> None:
        require(0 <= self.gamma <= 1, "gae.gamma", "in [0, 1]", self.gamma)
        require(0 <= self.lam <= 1, "gae.lam", "in [0, 1]", self.lam)


def _ppo_critic() -> CriticConfig:
    return CriticConfig(
        micro_batch_size=128,
        optim=OptimConfig(lr=3e-3, grad_clip=1.0),
        lora=LoraConfig(rank=8, alpha=16.0),
    )


def _ppo_rollout() -> RolloutConfig:
    return RolloutConfig(prompts_per_step=256, group_size=2)


def _ppo_train() -> LoopConfig:
    return LoopConfig(steps=200, ppo_epochs=1, mini_batch_size=128)


def _ppo_output() -> OutputConfig:
    return OutputConfig(dir="outputs/ppo_lora")


@dataclass
class PPOExampleConfig:
    """``examples/ppo_lora.py`` (defaults: ``configs/ppo_lora.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=_ppo_rollout)
    actor: ActorConfig = field(default_factory=partial(_lora_actor, "ppo", kl_coef=0.01))
    critic: CriticConfig = field(default_factory=_ppo_critic)
    gae: GAEConfig = field(default_factory=GAEConfig)
    train: LoopConfig = field(default_factory=_ppo_train)
    output: OutputConfig = field(default_factory=_ppo_output)

    def __post_init__(self) -> None:
        check_refusals("recipe", self, recipe="ppo")  # docs/recipes.md#what-composes
