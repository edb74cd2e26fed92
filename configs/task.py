"""The ``task`` section of a run: what it trains on, its held-out prompts and its reward.

:func:`microrl.tasks.make_task` builds the task from it (docs/tasks.md). It nests one section per
concern (:mod:`microrl.configs.task_sections`: ``dataset``, ``images``, ``rewards``,
``reward_model``, ``agent``; :mod:`microrl.configs.judge`: ``judge``), each checking its own keys;
what ties them to ``task.name`` and to each other is checked by the rows of
:mod:`microrl.configs.refusals`. It lives beside :mod:`microrl.configs.run`, which re-exports it
with the run's other sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from microrl.configs.fields import config_field, require
from microrl.configs.judge import JudgeConfig
from microrl.configs.refusals import check_refusals
from microrl.configs.task_names import (
    AGENT_TASK_NAMES,
    DEFAULT_MAX_OPERAND,
    EPISODE_TASK_NAMES,
    FILE_TASK_NAMES,
    TASK_NAMES,
)
from microrl.configs.task_sections import (
    DEFAULT_AGENT_MAX_CONCURRENCY,
    AgentConfig,
    DatasetConfig,
    ImagesConfig,
    RewardModelConfig,
    RewardsConfig,
)

__all__ = [
    "AGENT_TASK_NAMES",
    "CALCULATOR_MIN_MAX_OPERAND",
    "DEFAULT_AGENT_MAX_CONCURRENCY",
    "EPISODE_TASK_NAMES",
    "FILE_TASK_NAMES",
    "TASK_NAMES",
    "AgentConfig",
    "DatasetConfig",
    "ImagesConfig",
    "RewardModelConfig",
    "RewardsConfig",
    "TaskConfig",
]

# The calculator task's operands are 3-digit: the smallest task.max_operand it takes.
CALCULATOR_MIN_MAX_OPERAND = 200


@dataclass
class TaskConfig:
    """The prompts, held-out prompts and reward of the run (docs/tasks.md).

    ``addition`` (``a+b=`` with ``0 <= a, b <= max_operand``) and ``word_problems`` are generated;
    ``dataset`` reads ``dataset.train_file`` (JSONL/Parquet, or a Hugging Face Hub dataset name;
    ``dataset.prompt_field`` and ``dataset.answer_field`` per row) and scores with the
    ``rewards.functions`` (``module:function`` import paths, summed with ``rewards.weights``),
    which get the rows' other fields too. ``eval_size`` prompts are held out and never trained on.
    Multi-turn: ``hinted_addition`` (addition as a guessing game with hints) and ``env`` (the
    dataset's prompts played against the environments ``env`` builds) run episodes
    (:mod:`microrl.tasks.environments`).
    """

    #: Keys of the flat ``task`` section before it nested, and where they went: the loader reads
    #: them for one release, with a warning naming the new key.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "train_file": "dataset.train_file",
        "eval_file": "dataset.eval_file",
        "dataset_config": "dataset.config",
        "train_split": "dataset.train_split",
        "eval_split": "dataset.eval_split",
        "prompt_field": "dataset.prompt_field",
        "answer_field": "dataset.answer_field",
        "chat_template": "dataset.chat_template",
        "image_field": "images.field",
        "image_marker": "images.marker",
        "max_pixels": "images.max_pixels",
        "rewards": "rewards.functions",
        "reward_weights": "rewards.weights",
        "overlong_buffer": "rewards.overlong_buffer",
        "overlong_penalty": "rewards.overlong_penalty",
        "reward_model": "reward_model.path",
        "reward_model_base": "reward_model.base",
        "reward_model_norm": "reward_model.norm",
        "reward_model_batch_size": "reward_model.batch_size",
        "reward_model_chat_template": "reward_model.chat_template",
        "agent": "agent.function",
        "agent_timeout_s": "agent.timeout_s",
        "agent_max_concurrency": "agent.max_concurrency",
        "agent_host": "agent.host",
        "agent_tool_parser": "agent.tool_parser",
    }

    name: str = config_field(
        "addition",
        "the task: addition, word_problems, dataset, hinted_addition, env, calculator or digits "
        "(docs/tasks.md)",
    )
    max_operand: int | None = config_field(
        None,
        "built-in tasks' largest number (null: the task's own, 99; digits 9, calculator 999): "
        "addition a+b= with 0 <= a, b <= it; word problems",
    )
    eval_size: int = config_field(
        500, "held-out prompts for the greedy accuracy, never trained on (dataset: rows)"
    )
    seed: int = config_field(
        0, "seed of the held-out split (and of the word problems' names and items)"
    )
    solved_threshold: float = config_field(
        1.0,
        "with task.rewards.functions or task.name=env: a held-out row is solved at a reward >= "
        "this",
    )
    env: str | None = config_field(
        None,
        "env: the environment factory, module:function or file.py:function, called with a "
        "microrl.tasks.Problem per row (docs/tasks.md#multi-turn-tasks)",
    )
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def reward_terms(self) -> list[str]:
        """The reward terms ``rewards.weights`` weighs, in order: each ``rewards.functions[i]``,
        then ``reward_model`` and ``judge`` when they are on."""
        terms = [f"task.rewards.functions[{i}]" for i in range(len(self.rewards.functions))]
        terms += ["task.reward_model"] * self.reward_model.enabled
        return terms + ["task.judge"] * self.judge.enabled

    @property
    def multi_turn(self) -> bool:
        """Whether the task's rows are episodes: a multi-turn task's or an agent's."""
        return self.name in EPISODE_TASK_NAMES or self.agent.enabled

    @property
    def operand_limit(self) -> int:
        """``max_operand``, or the task's own when it is null. Resolved on read, never written
        back: a config built before ``task.name`` is overridden keeps null, the new task's."""
        if self.max_operand is None:
            return DEFAULT_MAX_OPERAND.get(self.name, 99)
        return self.max_operand

    def __post_init__(self) -> None:
        require(self.name in TASK_NAMES, "task.name", f"one of {', '.join(TASK_NAMES)}", self.name)
        limit = self.operand_limit
        require(1 <= limit <= 9999, "task.max_operand", "in [1, 9999]", self.max_operand)
        require(self.eval_size >= 1, "task.eval_size", ">= 1", self.eval_size)
        if self.name == "addition":
            require(
                self.eval_size < (limit + 1) ** 2,
                "task.eval_size",
                f"in [1, {(limit + 1) ** 2 - 1}]",
                self.eval_size,
            )
        if self.name == "digits":
            require(
                limit <= 99,
                "task.max_operand",
                "in [1, 99] for task.name=digits (numbers of at most two digits; 9: one digit, "
                "what the toy model learns)",
                limit,
            )
        require(
            self.name != "calculator" or limit >= CALCULATOR_MIN_MAX_OPERAND,
            "task.max_operand",
            f">= {CALCULATOR_MIN_MAX_OPERAND} for task.name=calculator (operands in "
            "[100, max_operand]: sums the model cannot do alone)",
            limit,
        )
        check_refusals("task", self)
