"""The sections ``task`` nests, one per concern: its prompt file, images, rewards, reward model and
agent (the judge: :mod:`microrl.configs.judge`).

Each checks its own keys, naming them by their full path (``task.dataset.train_file``); what
ties a section to another (``task.name=dataset`` needs ``task.dataset.train_file``) is a row of
:mod:`microrl.configs.refusals`.
"""

from __future__ import annotations

from dataclasses import dataclass

from microrl.configs.fields import config_field, require

__all__ = [
    "DEFAULT_AGENT_MAX_CONCURRENCY",
    "AgentConfig",
    "DatasetConfig",
    "ImagesConfig",
    "RewardModelConfig",
    "RewardsConfig",
]

# Agent episodes running at once per process by default: a step's (GRPO's default: 1024) at once
# overwhelm a small machine's event loop; vLLM's default batch (max_num_seqs) is 256.
DEFAULT_AGENT_MAX_CONCURRENCY = 256
REWARD_MODEL_NORMS = ("none", "batch", "group")


@dataclass
class DatasetConfig:
    """The prompt file of ``task.name=dataset`` and ``env`` (docs/tasks.md#dataset-format)."""

    train_file: str | None = config_field(
        None, "the training prompts, a .jsonl or .parquet file or a Hub dataset name"
    )
    eval_file: str | None = config_field(
        None, "held-out prompts file or Hub name (null: task.eval_size rows of train_file)"
    )
    config: str | None = config_field(
        None, "the config (subset) of a Hub dataset, e.g. main for openai/gsm8k"
    )
    train_split: str = config_field("train", "the split of a Hub train_file")
    eval_split: str = config_field("test", "the split of a Hub eval_file")
    prompt_field: str = config_field("prompt", "the field of a row holding the prompt")
    answer_field: str = config_field("answer", "the field holding the reference answer")
    chat_template: bool = config_field(False, "render prompts with the tokenizer's chat template")

    def __post_init__(self) -> None:
        for key in ("train_split", "eval_split", "prompt_field", "answer_field"):
            value = getattr(self, key)
            require(isinstance(value, str) and bool(value), f"task.dataset.{key}", "a name", value)


@dataclass
class ImagesConfig:
    """Images in the prompts: a dataset's image field, and the bound every image is resized to
    (docs/tasks.md#images-in-datasets, docs/rollouts.md#images)."""

    field: str | None = config_field(
        None,
        "task.name=dataset: the field holding each row's image(s): a path (relative to the "
        "file), a file:// or http(s):// URL, or bytes",
    )
    marker: str | None = config_field(
        None,
        "a text each prompt writes where an image goes (e.g. <image>), replaced by the model's "
        "image placeholder",
    )
    # Qwen-VL's own max_pixels resize: 1280 image tokens of 28 x 28 pixels for Qwen2/2.5-VL
    # (Qwen's suggested bound); a checkpoint's smaller bound stays.
    max_pixels: int | None = config_field(
        1280 * 28 * 28,
        "the most pixels an image keeps, resized as the model's image processor does (null: the "
        "checkpoint's own bound)",
    )

    def __post_init__(self) -> None:
        require(
            self.field is None or (isinstance(self.field, str) and bool(self.field)),
            "task.images.field",
            "null or a field name",
            self.field,
        )
        require(
            self.marker is None
            or (self.field is not None and isinstance(self.marker, str)
                and bool(self.marker.strip())),
            "task.images.marker",
            "null, or a non-empty text with task.images.field set",
            self.marker,
        )  # fmt: skip
        require(
            self.max_pixels is None
            or (isinstance(self.max_pixels, int) and not isinstance(self.max_pixels, bool)
                and self.max_pixels >= 1),
            "task.images.max_pixels",
            "null or an int >= 1 (pixels per image)",
            self.max_pixels,
        )  # fmt: skip


@dataclass
class RewardsConfig:
    """Reward functions by import path, the weights of every reward term, and DAPO's soft
    overlong penalty (docs/tasks.md#reward-functions, docs/tasks.md#overlong-penalty)."""

    functions: list[str] = config_field(
        [],
        "reward functions [module:function, file.py:function] (dataset: needed; built-in tasks: "
        "replace their reward)",
    )
    weights: list[float] = config_field(
        [],
        "a weight per reward term, in the order task.rewards.functions, task.reward_model, "
        "task.judge (empty: 1.0 each)",
    )
    # DAPO's soft overlong punishment (Yu et al. 2025), added to each row's reward by the recipes
    # (microrl.tasks.overlong_penalty); the held-out accuracy keeps the task's own score.
    overlong_buffer: int = config_field(
        0,
        "DAPO's soft overlong penalty: the last N tokens before rollout.max_new_tokens cost "
        "reward linearly (0: off)",
    )
    overlong_penalty: float = config_field(
        1.0, "the overlong penalty at rollout.max_new_tokens (with overlong_buffer > 0)"
    )

    def __post_init__(self) -> None:
        require(
            self.overlong_buffer >= 0,
            "task.rewards.overlong_buffer",
            ">= 0",
            self.overlong_buffer,
        )
        require(
            0 <= self.overlong_penalty < float("inf"),
            "task.rewards.overlong_penalty",
            "a finite float >= 0",
            self.overlong_penalty,
        )


@dataclass
class RewardModelConfig:
    """A scalar reward model scoring prompt + response as a reward term
    (:mod:`microrl.tasks.reward_model`, docs/tasks.md#reward-models); ``path`` empty: none."""

    path: str | None = config_field(
        None,
        "a sequence-classification reward model (a path or Hub id), or a RewardModelEngine "
        "checkpoint (null: none)",
    )
    base: str | None = config_field(
        None, "the base model a RewardModelEngine checkpoint in path was trained from"
    )
    norm: str = config_field("none", "its scores: none, batch or group (standardised per prompt)")
    batch_size: int = config_field(8, "rows per reward-model forward")
    chat_template: bool = config_field(
        False, "render prompt and response with the reward model's own chat template"
    )

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def __post_init__(self) -> None:
        require(
            self.norm in REWARD_MODEL_NORMS,
            "task.reward_model.norm",
            ", ".join(REWARD_MODEL_NORMS[:-1]) + f" or {REWARD_MODEL_NORMS[-1]}",
            self.norm,
        )
        require(self.batch_size >= 1, "task.reward_model.batch_size", ">= 1", self.batch_size)
        require(
            not self.base or self.enabled,
            "task.reward_model.base",
            "unset without task.reward_model.path",
            self.base,
        )


@dataclass
class AgentConfig:
    """An agent written against the OpenAI API playing the task's prompts as episodes through
    an endpoint microrl serves (docs/rollouts.md#agents); ``function`` empty: none."""

    function: str | None = config_field(
        None,
        "an agent, module:function or file.py:function, called as agent(client, problem) -> "
        "reward with an openai client; the task's prompts become its episodes",
    )
    timeout_s: float = config_field(
        600.0, "seconds an episode may run (past it: an error, or skip_env_errors drops it)"
    )
    max_concurrency: int = config_field(
        DEFAULT_AGENT_MAX_CONCURRENCY, "episodes running at once on a process (0: all of a step's)"
    )
    host: str = config_field(
        "127.0.0.1",
        "the address the endpoint listens on; another exposes it to that network "
        "(key-protected, docs/rollouts.md#agents)",
    )
    tool_parser: str | None = config_field(
        None,
        "the tool-call parser the endpoint applies to replies, e.g. hermes (vLLM's named parsers "
        "too where vLLM is installed); null: content only, except hermes for task.name="
        "calculator (docs/rollouts.md#tool-parsers)",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.function)

    def __post_init__(self) -> None:
        require(
            self.tool_parser is None or self.enabled,
            "task.agent.tool_parser",
            "null unless task.agent.function is set (it parses the agent's replies)",
            self.tool_parser,
        )
        require(
            self.tool_parser is None
            or (isinstance(self.tool_parser, str) and bool(self.tool_parser.strip())),
            "task.agent.tool_parser",
            "null or a parser name such as hermes",
            self.tool_parser,
        )
        require(self.timeout_s > 0, "task.agent.timeout_s", "> 0", self.timeout_s)
        require(
            self.max_concurrency >= 0, "task.agent.max_concurrency", ">= 0", self.max_concurrency
        )
