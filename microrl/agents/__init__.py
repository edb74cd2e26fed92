"""Agents as users write them: an OpenAI-compatible endpoint in front of the run's sampler.

Users' agent code (the ``openai`` client, or a framework on it) generates through
:class:`~microrl.agents.endpoint.AgentEndpoint`, served from a thread of the trainer process;
:func:`~microrl.agents.runner.run_agent_episodes` runs ``agent(client, problem) -> reward``
episodes and returns the token-exact rows (:mod:`microrl.agents.trajectories`) as a rollout.
Tool calls in a turn's text become OpenAI ``tool_calls`` by :mod:`microrl.agents.tool_parsers`.
See docs/rollouts.md#agents.
"""

from microrl.agents.endpoint import AgentEndpoint
from microrl.agents.runner import AGENT_METRICS, EPISODE_KEY, AgentLimits, run_agent_episodes
from microrl.agents.sampler import BatchingSampler, Turn
from microrl.agents.trajectories import EpisodeRecorder

__all__ = [
    "AGENT_METRICS",
    "EPISODE_KEY",
    "AgentEndpoint",
    "AgentLimits",
    "BatchingSampler",
    "EpisodeRecorder",
    "Turn",
    "run_agent_episodes",
]
