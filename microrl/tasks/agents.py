"""Agent tasks: a task's prompts played as episodes of the user's agent (docs/tasks.md).

``task.agent.function=module:function`` wraps any prompt task: each problem becomes an episode of
``agent(client, problem)``, whose openai ``client`` talks to microrl's endpoint
(:mod:`microrl.agents`). The agent returns the episode's reward, or a transcript (text) that
the wrapped task's reward scores (a dataset without ``task.rewards.functions`` scores none: its agent
returns the reward).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from microrl.configs.task import DEFAULT_AGENT_MAX_CONCURRENCY
from microrl.tasks.base import Problem, Task

__all__ = ["AgentTask", "is_agent_task"]


def is_agent_task(task: Any) -> bool:
    """Whether ``task``'s episodes are played by an agent through the endpoint."""
    return isinstance(task, AgentTask)


class AgentTask:
    """The problems of ``prompts`` played by ``agent`` (see the module docstring).

    Args:
        prompts: the task whose ``sample``/``eval_problems`` give the problems and whose
            ``score`` scores an agent's transcript.
        agent: ``agent(client, problem) -> reward | transcript`` (``async def``: an
            ``openai.AsyncOpenAI`` client; a plain function: ``openai.OpenAI``).
        timeout_s, max_concurrency, host: ``task.agent.timeout_s``,
            ``task.agent.max_concurrency``, ``task.agent.host``.
        tool_parser: parses the model's tool calls in replies (None: content only).
        scores_transcripts: whether ``prompts`` scores transcripts (False: a dataset without
            ``task.rewards.functions``, whose agent must return the reward).
    """

    def __init__(
        self,
        prompts: Task,
        agent: Callable[[Any, Problem], Any],
        *,
        timeout_s: float = 600.0,
        max_concurrency: int = DEFAULT_AGENT_MAX_CONCURRENCY,
        host: str = "127.0.0.1",
        tool_parser: Any = None,
        scores_transcripts: bool = True,
    ) -> None:
        if not callable(agent):
            raise TypeError(
                f"task.agent.function must be callable (client, problem), got {agent!r}"
            )
        self.prompts = prompts
        self.agent = agent
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.host = host
        self.tool_parser = tool_parser
        self.scores_transcripts = scores_transcripts
        self.solved_threshold = prompts.solved_threshold

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return self.prompts.sample(rng, n)

    def eval_problems(self) -> list[Problem]:
        return self.prompts.eval_problems()

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """The wrapped task's reward of agents' transcripts."""
        return self.prompts.score(responses, problems)

    def reward(self, result: Any, problem: Problem) -> float:
        """An episode's reward from what its agent returned: a transcript (text) is scored."""
        if not isinstance(result, str):
            raise TypeError(
                f"returned {type(result).__name__}: an agent returns a float reward or a "
                "transcript (str) the task scores"
            )
        if not self.scores_transcripts:
            raise TypeError(
                "returned a transcript (str), but task.rewards.functions is empty: return a float reward, "
                "or set task.rewards.functions to score transcripts"
            )
        return float(self.score([result], [problem])[0])
