"""Typed configs of the example trainings (``examples/grpo_lora.py``, ``examples/ppo_lora.py``).

Each is one top-level dataclass that nests the run's sections (:mod:`microrl.configs.run`) with
its engines' configs (:mod:`microrl.configs.engine`); the YAML files beside this module hold the
defaults a run starts from, and ``key.sub=value`` overrides on the command line change them
(:func:`microrl.configs.loader.load_config`). The library never imports this module
(tests/test_imports.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microrl.configs.engine import ActorConfig, CriticConfig, LoraConfig, OptimConfig
from microrl.configs.fields import config_field, require
from microrl.configs.run import (
    EPISODE_TASK_NAMES,
    LoopConfig,
    ModelConfig,
    OutputConfig,
    RolloutConfig,
    TaskConfig,
)
from microrl.configs.teacher import TeacherConfig
from microrl.losses.config import PolicyLossConfig

__all__ = ["GAEConfig", "GRPOExampleConfig", "PPOExampleConfig"]


def _grpo_actor() -> ActorConfig:
    return ActorConfig(
        micro_batch_size=128,
        temperature=1.0,
        optim=OptimConfig(lr=2e-3, grad_clip=1.0),
        lora=LoraConfig(rank=8, alpha=16.0),
        policy_loss=PolicyLossConfig(name="grpo", kl_coef=0.0),
    )


def _grpo_rollout() -> RolloutConfig:
    # max_episode_tokens: the toy model's 32 positions (multi-turn tasks)
    return RolloutConfig(prompts_per_step=128, group_size=8, max_episode_tokens=24)


def _grpo_train() -> LoopConfig:
    return LoopConfig(ppo_epochs=1, mini_batch_size=256)


def _check_actor_and_batches(actor: ActorConfig, rollout: RolloutConfig, train: LoopConfig) -> None:
    # The reference policy is the base model with the adapter disabled: a full fine-tune
    # (rank 0) has none, so it trains without the KL (as DAPO does) and reports none.
    require(
        actor.lora.rank >= 1 or (actor.policy_loss.kl_coef == 0 and train.kl_metric_every == 0),
        "actor.lora.rank",
        ">= 1 while the KL to the reference is penalised or reported (the reference is the base "
        "model with the adapter disabled); a full fine-tune (0) needs "
        "actor.policy_loss.kl_coef=0 and train.kl_metric_every=0",
        actor.lora.rank,
    )
    # vLLM samples with its own kernels from a synced copy of the weights: its log-probs are not
    # the trainer's (docs/losses.md#bypass-mode-bypass_mode), so the old pass must recompute them.
    require(
        not actor.policy_loss.bypass_mode or rollout.backend == "hf",
        "actor.policy_loss.bypass_mode",
        "false with rollout.backend=vllm (vLLM's log-probs are not the trainer's: the bypass "
        "needs rollout.backend=hf, which samples the trained model itself)",
        actor.policy_loss.bypass_mode,
    )
    rollout_size = rollout.prompts_per_step * rollout.group_size
    require(
        rollout_size % train.mini_batch_size == 0,
        "train.mini_batch_size",
        f"a divisor of rollout.prompts_per_step * rollout.group_size = {rollout_size}",
        train.mini_batch_size,
    )


def _check_overlong(task: TaskConfig, rollout: RolloutConfig) -> None:
    # DAPO's soft overlong penalty ramps over the last task.overlong_buffer tokens before
    # rollout.max_new_tokens: the ramp must start after the first token.
    require(
        task.overlong_buffer < rollout.max_new_tokens,
        "task.overlong_buffer",
        f"below rollout.max_new_tokens = {rollout.max_new_tokens} (0: off)",
        task.overlong_buffer,
    )
    # An episode's response is several turns of up to max_new_tokens each, with observations
    # between them: DAPO's per-response length rule has no single limit to ramp towards.
    require(
        task.overlong_buffer == 0 or (task.name not in EPISODE_TASK_NAMES and not task.agent),
        "task.overlong_buffer",
        f"0 for a multi-turn task (task.name={task.name}, task.agent; rollout.max_episode_tokens bounds "
        "an episode)",
        task.overlong_buffer,
    )


def _check_async(actor: ActorConfig, rollout: RolloutConfig) -> None:
    # Both recipes' rules for rollout.max_staleness = k > 0 (docs/async.md):
    # the trainer recomputes the old log-probs (the proximal policy the ratio is anchored on; the
    # bypass would anchor it on a stale policy's).
    k = rollout.max_staleness
    require(
        k == 0 or not actor.policy_loss.bypass_mode,
        "actor.policy_loss.bypass_mode",
        f"false with rollout.max_staleness={k} (the old log-probs must be the trainer's "
        "recomputed ones, the proximal policy; the sampler's are a stale behaviour policy)",
        actor.policy_loss.bypass_mode,
    )


@dataclass
class GRPOExampleConfig:
    """``examples/grpo_lora.py`` (defaults: ``configs/grpo_lora.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=_grpo_rollout)
    actor: ActorConfig = field(default_factory=_grpo_actor)
    train: LoopConfig = field(default_factory=_grpo_train)
    output: OutputConfig = field(default_factory=OutputConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)

    def __post_init__(self) -> None:
        require(
            self.rollout.group_size >= 2,
            "rollout.group_size",
            ">= 2 for GRPO",
            self.rollout.group_size,
        )
        _check_actor_and_batches(self.actor, self.rollout, self.train)
        _check_overlong(self.task, self.rollout)
        _check_async(self.actor, self.rollout)
        # The ranks of a sequence-parallel group train the same rows; agents on each would play
        # different episodes (their calls and timing are theirs).
        require(
            self.task.agent is None or self.actor.sequence_parallel_size == 1,
            "task.agent",
            "null with actor.sequence_parallel_size > 1 (an sp group's ranks would play "
            "different episodes)",
            self.task.agent,
        )
        _check_teacher(self.teacher, self.task)


def _check_teacher(teacher: TeacherConfig, task: TaskConfig) -> None:
    # Multi-turn rows hold observations the teacher would score too: not supported yet.
    multi_turn = task.name in EPISODE_TASK_NAMES or task.agent is not None
    require(
        not (teacher.enabled and multi_turn),
        "teacher.path",
        f"empty for a multi-turn task (task.name={task.name}, task.agent={task.agent}; "
        "distillation scores single-turn responses)",
        teacher.path,
    )


@dataclass
class GAEConfig:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens."""

    gamma: float = config_field(1.0, "discount per token (1: the final reward counts fully)")
    lam: float = config_field(0.95, "GAE lambda: bias (0) vs variance (1) of the advantages")

    def __post_init__(self) -> None:
        require(0 <= self.gamma <= 1, "gae.gamma", "in [0, 1]", self.gamma)
        require(0 <= self.lam <= 1, "gae.lam", "in [0, 1]", self.lam)


def _ppo_actor() -> ActorConfig:
    return ActorConfig(
        micro_batch_size=128,
        temperature=1.0,
        optim=OptimConfig(lr=2e-3, grad_clip=1.0),
        lora=LoraConfig(rank=8, alpha=16.0),
        policy_loss=PolicyLossConfig(name="ppo", kl_coef=0.01),
    )


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
    actor: ActorConfig = field(default_factory=_ppo_actor)
    critic: CriticConfig = field(default_factory=_ppo_critic)
    gae: GAEConfig = field(default_factory=GAEConfig)
    train: LoopConfig = field(default_factory=_ppo_train)
    output: OutputConfig = field(default_factory=_ppo_output)

    def __post_init__(self) -> None:
        _check_actor_and_batches(self.actor, self.rollout, self.train)
        _check_overlong(self.task, self.rollout)
        # A group whose rewards are all equal still has GAE advantages under PPO's critic:
        # filtering groups by their reward spread is a GRPO rule (examples/grpo_lora.py).
        require(
            not self.rollout.dynamic_sampling,
            "rollout.dynamic_sampling",
            "false for PPO (dynamic sampling keeps groups whose rewards differ, which only "
            "group-relative advantages need: use examples/grpo_lora.py)",
            self.rollout.dynamic_sampling,
        )
        _check_async(self.actor, self.rollout)
        # Under sequence parallelism an sp group's processes are one data rank: they sample the
        # same prompts and pass both engines the same mini-batches. With two sizes the processes
        # one engine needs to hold the same rows would be separate data ranks of the other,
        # which would count those rows twice: one layout for both engines.
        sizes = self.actor.sequence_parallel_size, self.critic.sequence_parallel_size
        require(
            sizes[0] == sizes[1],
            "critic.sequence_parallel_size",
            f"equal to actor.sequence_parallel_size = {sizes[0]} for PPO (an sp group's "
            "processes are one data rank, which both engines must share)",
            sizes[1],
        )
        require(
            self.task.name not in EPISODE_TASK_NAMES,
            "task.name",
            "a single-turn task for PPO (multi-turn tasks train with examples/grpo_lora.py, "
            "whose group baseline needs no value of the observation tokens)",
            self.task.name,
        )
        require(
            self.task.agent is None,
            "task.agent",
            "null for PPO (agents train with examples/grpo_lora.py, whose group baseline needs "
            "no value of the observation tokens)",
            self.task.agent,
        )
