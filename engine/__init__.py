"""microrl.engine: the micro-batched training engine (docs/engine.md).

``ActorEngine``, ``CriticEngine`` and ``RewardModelEngine`` share ``Engine``'s loop; a new role
overrides the head and the loss. ``estimate_memory``: the bytes per device a config needs.
"""

from microrl.engine.actor import ActorEngine
from microrl.engine.base import Engine, LossFn
from microrl.engine.critic import CriticEngine
from microrl.engine.memory import MemoryEstimate, estimate_memory
from microrl.engine.outputs import StepResult
from microrl.engine.reward import RewardModelEngine

__all__ = [
    "ActorEngine",
    "CriticEngine",
    "Engine",
    "LossFn",
    "MemoryEstimate",
    "RewardModelEngine",
    "StepResult",
    "estimate_memory",
]
