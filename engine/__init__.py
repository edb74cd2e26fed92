"""microrl.engine: the micro-batched training engine (docs/engine.md).

``ActorEngine`` (policy log-probs + policy loss), ``CriticEngine`` (values + value loss) and
``RewardModelEngine`` (a score per sequence + the Bradley-Terry pairwise loss) share the loop of
``Engine``; a new role overrides the head and the loss, not the loop (``forward_step`` returns a
``StepResult``). ``estimate_memory`` tells the bytes per device an engine config needs for a
model, before building it.
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
