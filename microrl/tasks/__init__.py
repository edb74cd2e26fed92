"""Tasks for the RL recipes: prompts, held-out prompts, rewards (docs/tasks.md).

:class:`Task` is what a recipe needs; :func:`make_task` builds one from the ``task`` config
section: :class:`AdditionTask` (the main job's test bed), :class:`WordProblemTask` (generated
arithmetic word problems, a numeric-answer reward) or :class:`DatasetTask` (the user's JSONL or
Parquet prompt file, scored by reward functions given by import path, :mod:`microrl.tasks.rewards`),
or a multi-turn task played against environments (:mod:`microrl.tasks.environments`) or by
the user's agent (:mod:`microrl.tasks.agents`); :class:`CalculatorTask` is a tool-use task for
agents (:mod:`microrl.tasks.calculator`). Model-based reward terms: a scalar reward model
(:mod:`microrl.tasks.reward_model`) and an LLM judge over an OpenAI-compatible endpoint
(:mod:`microrl.tasks.judge`).
A task knows nothing of the model that learns it: the toy model of the examples and its supervised
warm start are part of a run (:mod:`microrl.run.toy_model`, :mod:`microrl.run.base_model`).
"""

from microrl.tasks.addition import AdditionTask, exact_match_reward, parse_answer
from microrl.tasks.agents import AgentTask, is_agent_task
from microrl.tasks.base import Problem, Task
from microrl.tasks.calculator import CalculatorTask
from microrl.tasks.dataset import DatasetTask
from microrl.tasks.environments import EnvTask, HintedAdditionTask, HintEnv, is_episode_task
from microrl.tasks.factory import BUILT_IN_TASKS, make_task
from microrl.tasks.overlong import overlong_penalty
from microrl.tasks.rewards import (
    Reward,
    RewardedTask,
    RewardError,
    load_reward,
    resolve_reward_fn,
)
from microrl.tasks.word_problems import WordProblemTask

__all__ = [
    "BUILT_IN_TASKS",
    "AdditionTask",
    "AgentTask",
    "CalculatorTask",
    "DatasetTask",
    "EnvTask",
    "HintEnv",
    "HintedAdditionTask",
    "Problem",
    "Reward",
    "RewardError",
    "RewardedTask",
    "Task",
    "WordProblemTask",
    "exact_match_reward",
    "is_agent_task",
    "is_episode_task",
    "load_reward",
    "make_task",
    "overlong_penalty",
    "parse_answer",
    "resolve_reward_fn",
]
