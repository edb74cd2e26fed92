"""Rollouts: sampling responses from the policy into the engine's batch layout (docs/rollouts.md).

One interface, :class:`RolloutBackend`, two backends: ``hf`` (:class:`HFRollout`, transformers
``generate`` on the engine's own model, no extra dependency) and ``vllm`` (:class:`VLLMRollout`,
a colocated ``vllm.LLM`` whose weights are synced from the engine after optimizer steps; the
optional ``vllm`` extra). Both return the same :class:`Rollout`: a token-aligned ``[B, T]``
batch with ``rollout_logprobs``, the decoded texts and the group id of each row. Samplers in other
processes (asynchronous RL) live in :mod:`microrl.remote` (docs/async.md).
"""

from microrl.engine.rollout.base import Rollout, RolloutBackend, SamplingParams
from microrl.engine.rollout.factory import make_rollout_backend
from microrl.engine.rollout.hf import HFRollout
from microrl.engine.rollout.layout import Samples, build_rollout
from microrl.engine.rollout.merge import merge_rollouts, select_groups
from microrl.engine.rollout.turns import turn_terminators

__all__ = [
    "HFRollout",
    "Rollout",
    "RolloutBackend",
    "Samples",
    "SamplingParams",
    "build_rollout",
    "make_rollout_backend",
    "merge_rollouts",
    "select_groups",
    "turn_terminators",
]


def __getattr__(name: str):
    if name == "VLLMRollout":  # imported on use: vllm is an optional dependency
        from microrl.engine.rollout.vllm import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
