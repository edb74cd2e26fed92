"""The names ``task.name`` takes, and the groups of them the checks of a run ask about."""

from __future__ import annotations

__all__ = [
    "AGENT_TASK_NAMES",
    "DEFAULT_MAX_OPERAND",
    "EPISODE_TASK_NAMES",
    "FILE_TASK_NAMES",
    "TASK_NAMES",
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
# Multi-turn tasks, played as episodes against environments (microrl.tasks.environments).
EPISODE_TASK_NAMES = ("hinted_addition", "env")
# Tasks that read the prompt file of task.dataset.
FILE_TASK_NAMES = ("dataset", "env")
# Each built-in task's task.max_operand when it is null (99 otherwise): the toy vision model
# reads one digit; the calculator's operands are 3-digit.
DEFAULT_MAX_OPERAND = {"digits": 9, "calculator": 999}
