"""The ``task`` section of a run: what it trains on, its held-out prompts and its reward.

:func:`microrl.tasks.make_task` builds the task from it (docs/tasks.md); every field carries its
one-line ``--help`` text and ``__post_init__`` validates it with a message naming the key. It
lives beside :mod:`microrl.configs.run`, which re-exports it with the run's other sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from microrl.configs.fields import config_field, require
from microrl.configs.judge import JudgeConfig

__all__ = [
    "AGENT_TASK_NAMES",
    "CALCULATOR_MIN_MAX_OPERAND",
    "DEFAULT_AGENT_MAX_CONCURRENCY",
    "EPISODE_TASK_NAMES",
    "TASK_NAMES",
    "TaskConfig",
]

# The tasks a recipe can train on (microrl.tasks.make_task builds them; docs/tasks.md).
TASK_NAMES = (
    "addition",
    "word_problems",
    "dataset",
    "hinted_addition",
    "env",
    "calculator",
    "digits",
)
# Built-in tasks played only by an agent through the endpoint (task.agent; microrl.agents).
AGENT_TASK_NAMES = ("calculator",)
# Agent episodes running at once per process by default: a step's (GRPO's default: 1024) at once
# overwhelm a small machine's event loop; vLLM's default batch (max_num_seqs) is 256.
DEFAULT_AGENT_MAX_CONCURRENCY = 256
# Each built-in task's task.max_operand when it is null (99 otherwise): the toy vision model
# reads one digit; the calculator's operands are 3-digit.
DEFAULT_MAX_OPERAND = {"digits": 9, "calculator": 999}
# The calculator task's operands are 3-digit: the smallest task.max_operand it takes.
CALCULATOR_MIN_MAX_OPERAND = 200
# Multi-turn tasks, played as episodes against environments (microrl.tasks.environments).
EPISODE_TASK_NAMES = ("hinted_addition", "env")
# Tasks that read task.train_file / task.eval_file.
_FILE_TASKS = ("dataset", "env")


@dataclass
class TaskConfig:
    """The prompts, held-out prompts and reward of the run (docs/tasks.md).

    ``addition`` (``a+b=`` with ``0 <= a, b <= max_operand``) and ``word_problems`` are generated;
    ``dataset`` reads ``train_file`` (JSONL/Parquet, or a Hugging Face Hub dataset name;
    ``prompt_field`` and ``answer_field`` per row) and scores with the ``rewards`` functions
    (``module:function`` import paths, summed with ``reward_weights``), which get the rows' other
    fields too. ``eval_size`` prompts are held out and never trained on. Multi-turn:
    ``hinted_addition`` (addition as a guessing game with hints) and ``env`` (``train_file``'s
    prompts played against the environments ``env`` builds) run episodes
    (:mod:`microrl.tasks.environments`).
    """

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
    train_file: str | None = config_field(
        None, "dataset: the training prompts, a .jsonl or .parquet file or a Hub dataset name"
    )
    eval_file: str | None = config_field(
        None, "dataset: held-out prompts file or Hub name (null: eval_size rows of train_file)"
    )
    dataset_config: str | None = config_field(
        None, "dataset: the config (subset) of a Hub dataset, e.g. main for openai/gsm8k"
    )
    train_split: str = config_field("train", "dataset: the split of a Hub train_file")
    eval_split: str = config_field("test", "dataset: the split of a Hub eval_file")
    prompt_field: str = config_field("prompt", "dataset: the field of a row holding the prompt")
    answer_field: str = config_field("answer", "dataset: the field holding the reference answer")
    image_field: str | None = config_field(
        None,
        "dataset: the field holding each row's image(s): a path (relative to the file), a "
        "file:// or http(s):// URL, or bytes (docs/tasks.md#images-in-datasets)",
    )
    image_marker: str | None = config_field(
        None,
        "dataset: a text each prompt writes where an image goes (e.g. <image>), replaced by the "
        "model's image placeholder (docs/tasks.md#images-in-datasets)",
    )
    # Qwen-VL's own max_pixels resize (docs/rollouts.md#images): 1280 image tokens of 28 x 28
    # pixels for Qwen2/2.5-VL (Qwen's suggested bound); a checkpoint's smaller bound stays.
    max_pixels: int | None = config_field(
        1280 * 28 * 28,
        "images: the most pixels an image keeps, resized as the model's image processor does "
        "(null: the checkpoint's own bound)",
    )
    chat_template: bool = config_field(
        False, "dataset: render prompts with the tokenizer's chat template"
    )
    rewards: list[str] = config_field(
        [],
        "reward functions [module:function, file.py:function] (dataset: needed; "
        "built-in tasks: replace their reward)",
    )
    reward_weights: list[float] = config_field(
        [],
        "a weight per reward term, in the order task.rewards, task.reward_model, task.judge "
        "(empty: 1.0 each)",
    )
    # Model-based rewards (microrl.tasks.reward_model, microrl.tasks.judge; docs/tasks.md).
    reward_model: str | None = config_field(
        None,
        "a sequence-classification reward model (a path or Hub id), or a RewardModelEngine "
        "checkpoint, scoring prompt+response",
    )
    reward_model_base: str | None = config_field(
        None, "the base model a RewardModelEngine checkpoint in task.reward_model was trained from"
    )
    reward_model_norm: str = config_field(
        "none", "the reward model's scores: none, batch or group (standardised per prompt)"
    )
    reward_model_batch_size: int = config_field(8, "rows per reward-model forward")
    reward_model_chat_template: bool = config_field(
        False, "render prompt and response with the reward model's own chat template"
    )
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    solved_threshold: float = config_field(
        1.0, "with task.rewards or task.name=env: a held-out row is solved at a reward >= this"
    )
    env: str | None = config_field(
        None,
        "env: the environment factory, module:function or file.py:function, called with a "
        "microrl.tasks.Problem per row (docs/tasks.md#multi-turn-tasks)",
    )
    # Agents written against the OpenAI API (docs/rollouts.md#agents).
    agent: str | None = config_field(
        None,
        "an agent, module:function or file.py:function, called as agent(client, problem) -> "
        "reward with an openai client; the task's prompts become its episodes",
    )
    agent_timeout_s: float = config_field(
        600.0, "agent: seconds an episode may run (past it: an error, or skip_env_errors drops it)"
    )
    agent_max_concurrency: int = config_field(
        DEFAULT_AGENT_MAX_CONCURRENCY,
        "agent: episodes running at once on a process (0: all of a step's)",
    )
    agent_host: str = config_field(
        "127.0.0.1",
        "agent: the address the endpoint listens on; another exposes it to that network "
        "(key-protected, docs/rollouts.md#agents)",
    )
    agent_tool_parser: str | None = config_field(
        None,
        "agent: the tool-call parser the endpoint applies to replies, e.g. hermes (vLLM's "
        "named parsers too where vLLM is installed); null: content only, except hermes for "
        "task.name=calculator (docs/rollouts.md#tool-parsers)",
    )
    # DAPO's soft overlong punishment (Yu et al. 2025), added to each row's reward by the recipes
    # (microrl.tasks.overlong_penalty); the held-out accuracy keeps the task's own score.
    overlong_buffer: int = config_field(
        0,
        "DAPO's soft overlong penalty: the last N tokens before rollout.max_new_tokens cost "
        "reward linearly (0: off; docs/tasks.md#overlong-penalty)",
    )
    overlong_penalty: float = config_field(
        1.0, "the overlong penalty at rollout.max_new_tokens (with task.overlong_buffer > 0)"
    )

    def reward_terms(self) -> list[str]:
        """The reward terms ``reward_weights`` weighs, in order: each ``task.rewards[i]``, then
        ``task.reward_model`` and ``task.judge`` when they are on."""
        terms = [f"task.rewards[{i}]" for i in range(len(self.rewards))]
        terms += ["task.reward_model"] * bool(self.reward_model)
        return terms + ["task.judge"] * self.judge.enabled

    def __post_init__(self) -> None:
        require(self.name in TASK_NAMES, "task.name", f"one of {', '.join(TASK_NAMES)}", self.name)
        if self.max_operand is None:
            self.max_operand = DEFAULT_MAX_OPERAND.get(self.name, 99)
        require(1 <= self.max_operand <= 9999, "task.max_operand", "in [1, 9999]", self.max_operand)
        require(self.eval_size >= 1, "task.eval_size", ">= 1", self.eval_size)
        if self.name == "addition":
            require(
                self.eval_size < (self.max_operand + 1) ** 2,
                "task.eval_size",
                f"in [1, {(self.max_operand + 1) ** 2 - 1}]",
                self.eval_size,
            )
        if self.name == "digits":
            require(
                self.max_operand <= 99,
                "task.max_operand",
                "in [1, 99] for task.name=digits (numbers of at most two digits; 9: one digit, "
                "what the toy model learns)",
                self.max_operand,
            )
        require(
            self.image_field is None
            or (
                self.name == "dataset"
                and isinstance(self.image_field, str)
                and bool(self.image_field)
            ),
            "task.image_field",
            "null, or a field name with task.name=dataset",
            self.image_field,
        )
        require(
            self.image_marker is None
            or (self.image_field is not None and isinstance(self.image_marker, str)
                and bool(self.image_marker.strip())),
            "task.image_marker",
            "null, or a non-empty text with task.image_field set",
            self.image_marker,
        )  # fmt: skip
        require(
            self.max_pixels is None
            or (isinstance(self.max_pixels, int) and not isinstance(self.max_pixels, bool)
                and self.max_pixels >= 1),
            "task.max_pixels",
            "null or an int >= 1 (pixels per image)",
            self.max_pixels,
        )  # fmt: skip
        is_dataset = self.name == "dataset"
        reads_files = self.name in _FILE_TASKS
        for key in ("train_file", "eval_file"):
            require(
                reads_files or getattr(self, key) is None,
                f"task.{key}",
                "null unless task.name=dataset or env (set task.name=dataset to train on a file)",
                getattr(self, key),
            )
        require(
            not reads_files or bool(self.train_file),
            "task.train_file",
            f"a .jsonl or .parquet file or a Hub dataset name for task.name={self.name}",
            self.train_file,
        )
        require(
            (self.name == "env") == bool(self.env),
            "task.env",
            "an environment factory (module:function) for task.name=env, and null otherwise",
            self.env,
        )
        require(
            not is_dataset or bool(self.reward_terms()) or bool(self.agent),
            "task.rewards",
            "a non-empty list of reward functions for task.name=dataset, e.g. "
            "[my_reward:score] or [microrl.tasks.rewards:exact_match] (or a "
            "task.reward_model or task.judge.url, or a task.agent that returns the reward)",
            self.rewards,
        )
        terms = self.reward_terms()
        require(
            not self.reward_weights or len(self.reward_weights) == len(terms),
            "task.reward_weights",
            f"empty or one weight per reward term ({len(terms)}: {', '.join(terms) or 'none'})",
            self.reward_weights,
        )
        require(
            self.agent is None or self.name not in ("env", "hinted_addition"),
            "task.agent",
            "null for task.name=env or hinted_addition (their environments play the episodes)",
            self.agent,
        )
        require(
            self.name not in AGENT_TASK_NAMES or bool(self.agent),
            "task.agent",
            f"an agent (module:function or file.py:function) for task.name={self.name}, e.g. "
            "examples/calculator_agent.py:agent",
            self.agent,
        )
        require(
            self.name != "calculator" or self.max_operand >= CALCULATOR_MIN_MAX_OPERAND,
            "task.max_operand",
            f">= {CALCULATOR_MIN_MAX_OPERAND} for task.name=calculator (operands in "
            "[100, max_operand]: sums the model cannot do alone)",
            self.max_operand,
        )
        require(
            self.agent_tool_parser is None or bool(self.agent),
            "task.agent_tool_parser",
            "null unless task.agent is set (it parses the agent's replies)",
            self.agent_tool_parser,
        )
        require(
            self.agent_tool_parser is None
            or (isinstance(self.agent_tool_parser, str) and bool(self.agent_tool_parser.strip())),
            "task.agent_tool_parser",
            "null or a parser name such as hermes",
            self.agent_tool_parser,
        )
        require(self.agent_timeout_s > 0, "task.agent_timeout_s", "> 0", self.agent_timeout_s)
        require(
            self.agent_max_concurrency >= 0,
            "task.agent_max_concurrency",
            ">= 0",
            self.agent_max_concurrency,
        )
        require(
            self.reward_model_norm in ("none", "batch", "group"),
            "task.reward_model_norm",
            "none, batch or group",
            self.reward_model_norm,
        )
        require(
            self.reward_model_batch_size >= 1,
            "task.reward_model_batch_size",
            ">= 1",
            self.reward_model_batch_size,
        )
        base = self.reward_model_base
        rule = "unset without task.reward_model"
        require(not base or bool(self.reward_model), "task.reward_model_base", rule, base)
        episodes = self.name in EPISODE_TASK_NAMES  # the environments give the rewards
        for key, value in (("reward_model", self.reward_model), ("judge.url", self.judge.url)):
            require(
                not (episodes and value),
                f"task.{key}",
                f"empty with task.name={self.name} (its environments give the rewards)",
                value,
            )
        require(self.overlong_buffer >= 0, "task.overlong_buffer", ">= 0", self.overlong_buffer)
        require(
            0 <= self.overlong_penalty < float("inf"),
            "task.overlong_penalty",
            "a finite float >= 0",
            self.overlong_penalty,
        )
