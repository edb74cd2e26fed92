"""The sections every training run has beside its engines: model, task, rollout, loop, output.

The example trainings (:mod:`microrl.configs.examples`) nest them, with their engines' configs,
into one top-level config, and the run library reads them: :mod:`microrl.run.base_model` the
``model`` section, :func:`microrl.tasks.make_task` the ``task`` section. Every field carries its
one-line ``--help`` text; each section validates its own ranges in ``__post_init__`` with a
message that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microrl.configs.fields import config_field, require
from microrl.configs.rollout import ROLLOUT_BACKENDS, VLLMConfig

__all__ = [
    "TASK_NAMES",
    "LoopConfig",
    "ModelConfig",
    "OutputConfig",
    "RolloutConfig",
    "TaskConfig",
    "WarmStartConfig",
]


@dataclass
class WarmStartConfig:
    """Supervised warm start of a freshly built base model (only when ``model.path`` is empty).

    It trains until the greedy accuracy on 200 training prompts (the held-out ones are kept for
    RL) reaches ``target_accuracy`` or ``max_steps`` pass: a partly trained base leaves RL
    visible room to improve.
    """

    max_steps: int = config_field(600, "most supervised warm-start steps")
    batch_size: int = config_field(64, "warm-start prompts per step, across all processes")
    lr: float = config_field(3e-3, "warm-start learning rate (AdamW, full fine-tune)")
    target_accuracy: float = config_field(0.3, "stop warm-starting at this greedy accuracy")
    eval_every: int = config_field(50, "measure the warm-start accuracy every N steps")

    def __post_init__(self) -> None:
        for key in ("max_steps", "batch_size", "eval_every"):
            require(getattr(self, key) >= 1, f"model.warm_start.{key}", ">= 1", getattr(self, key))
        require(self.lr > 0, "model.warm_start.lr", "> 0", self.lr)
        require(
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
    saved there (:mod:`microrl.run.toy_model`).
    """

    path: str = config_field(
        "outputs/base/tiny-adder", "base model: loaded, or built, warm-started and saved here"
    )
    hidden_size: int = config_field(64, "width of a newly built base model")
    intermediate_size: int = config_field(256, "MLP width of a newly built base model")
    num_layers: int = config_field(2, "decoder layers of a newly built base model")
    num_heads: int = config_field(4, "attention heads of a newly built base model")
    head_dim: int = config_field(
        32, "width of each head (vLLM's CPU attention needs >= 32); 0: hidden_size / num_heads"
    )
    max_positions: int = config_field(32, "longest sequence a newly built base model handles")
    seed: int = config_field(0, "seed of a newly built base model's weights and of its warm start")
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)

    def __post_init__(self) -> None:
        require(bool(self.path), "model.path", "a non-empty path", self.path)
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "max_positions"):
            require(getattr(self, key) >= 1, f"model.{key}", ">= 1", getattr(self, key))
        require(self.head_dim >= 0, "model.head_dim", ">= 0", self.head_dim)
        require(
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

    name: str = config_field(
        "addition", "the task: addition, word_problems or dataset (docs/tasks.md)"
    )
    max_operand: int = config_field(
        99, "built-in tasks' largest number: addition a+b= with 0 <= a, b <= it; word problems"
    )
    eval_size: int = config_field(
        500, "held-out prompts for the greedy accuracy, never trained on (dataset: rows)"
    )
    seed: int = config_field(
        0, "seed of the held-out split (and of the word problems' names and items)"
    )
    train_file: str | None = config_field(
        None, "dataset: the training prompts, a .jsonl or .parquet file"
    )
    eval_file: str | None = config_field(
        None, "dataset: held-out prompts file (null: eval_size rows held out of train_file)"
    )
    prompt_field: str = config_field("prompt", "dataset: the field of a row holding the prompt")
    answer_field: str = config_field("answer", "dataset: the field holding the reference answer")
    chat_template: bool = config_field(
        False, "dataset: render prompts with the tokenizer's chat template"
    )
    rewards: list[str] = config_field(
        [],
        "reward functions [module:function, file.py:function] (dataset: needed; "
        "built-in tasks: replace their reward)",
    )
    reward_weights: list[float] = config_field(
        [], "a weight per entry of task.rewards (empty: 1.0 each)"
    )
    solved_threshold: float = config_field(
        1.0, "with task.rewards: a held-out response is solved at a reward >= this"
    )

    def __post_init__(self) -> None:
        require(self.name in TASK_NAMES, "task.name", f"one of {', '.join(TASK_NAMES)}", self.name)
        require(1 <= self.max_operand <= 9999, "task.max_operand", "in [1, 9999]", self.max_operand)
        require(self.eval_size >= 1, "task.eval_size", ">= 1", self.eval_size)
        if self.name == "addition":
            require(
                self.eval_size < (self.max_operand + 1) ** 2,
                "task.eval_size",
                f"in [1, {(self.max_operand + 1) ** 2 - 1}]",
                self.eval_size,
            )
        is_dataset = self.name == "dataset"
        for key in ("train_file", "eval_file"):
            require(
                is_dataset or getattr(self, key) is None,
                f"task.{key}",
                "null unless task.name=dataset (set task.name=dataset to train on a file)",
                getattr(self, key),
            )
        require(
            not is_dataset or bool(self.train_file),
            "task.train_file",
            "a .jsonl or .parquet file of prompts for task.name=dataset",
            self.train_file,
        )
        require(
            not is_dataset or bool(self.rewards),
            "task.rewards",
            "a non-empty list of reward functions for task.name=dataset, e.g. "
            "[my_reward:score] or [microrl.tasks.rewards:exact_match]",
            self.rewards,
        )
        require(
            not self.reward_weights or len(self.reward_weights) == len(self.rewards),
            "task.reward_weights",
            f"empty or one weight per entry of task.rewards ({len(self.rewards)})",
            self.reward_weights,
        )


@dataclass
class RolloutConfig:
    """Sampling. The temperature is ``actor.temperature``: the loss must score the same policy
    that sampled, so there is deliberately no second temperature here."""

    prompts_per_step: int = config_field(32, "prompts sampled per step, across all processes")
    group_size: int = config_field(8, "responses sampled per prompt (a GRPO group)")
    max_new_tokens: int = config_field(4, "longest response, in tokens (<eos> included)")
    backend: str = config_field("hf", "hf (transformers generate) or vllm (docs/rollouts.md)")
    sync_every: int = config_field(1, "vllm: load the trained weights into vLLM every N steps")
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def __post_init__(self) -> None:
        require(
            self.backend in ROLLOUT_BACKENDS,
            "rollout.backend",
            f"one of {', '.join(ROLLOUT_BACKENDS)}",
            self.backend,
        )
        require(self.sync_every >= 1, "rollout.sync_every", ">= 1", self.sync_every)
        require(
            self.prompts_per_step >= 1, "rollout.prompts_per_step", ">= 1", self.prompts_per_step
        )
        require(self.group_size >= 1, "rollout.group_size", ">= 1", self.group_size)
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)


@dataclass
class LoopConfig:
    """The outer loop: ``steps`` rollouts, each followed by ``ppo_epochs`` passes over it in
    mini-batches of ``mini_batch_size`` sequences (one optimizer step each)."""

    steps: int = config_field(300, "RL steps (one rollout and its updates each); the last step run")
    ppo_epochs: int = config_field(2, "passes over each rollout")
    mini_batch_size: int = config_field(128, "sequences per optimizer step, across all processes")
    eval_every: int = config_field(
        25, "held-out greedy accuracy every N steps (and at the last step)"
    )
    seed: int = config_field(0, "seed of the LoRA initialisation, prompt order and sampling")
    # The tiny model's matrices are too small to gain from intra-op threads, and extra threads
    # spin badly on a busy or small CPU.
    num_threads: int = config_field(1, "CPU threads per process (0: torch's default)")

    def __post_init__(self) -> None:
        for key in ("steps", "ppo_epochs", "mini_batch_size", "eval_every"):
            require(getattr(self, key) >= 1, f"train.{key}", ">= 1", getattr(self, key))
        require(self.num_threads >= 0, "train.num_threads", ">= 0", self.num_threads)


@dataclass
class OutputConfig:
    """What a run writes into ``dir`` (metrics, TensorBoard, curves, adapter, checkpoint) and
    what it prints while it trains."""

    dir: str = config_field(
        "outputs/grpo_lora",
        "where the run writes (holding a checkpoint: --resume or --overwrite)",
    )
    save_every: int = config_field(0, "checkpoint every N steps (0: only at the end and on Ctrl-C)")
    tensorboard: bool = config_field(True, "write TensorBoard scalars to output.dir/tensorboard")
    plot: bool = config_field(True, "draw output.dir/curves.png at the end")
    progress: bool = config_field(True, "a live progress bar when stdout is a terminal")
    log_every: int = config_field(10, "without the bar: a plain line every N steps (0: none)")

    def __post_init__(self) -> None:
        require(bool(self.dir), "output.dir", "a non-empty path", self.dir)
        require(self.save_every >= 0, "output.save_every", ">= 0", self.save_every)
        require(self.log_every >= 0, "output.log_every", ">= 0", self.log_every)
