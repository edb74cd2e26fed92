"""microrl: a micro-batched RL training engine for language models (README.md, docs/).

The names below are the top-level API; they are imported on first use, so that
``import microrl.kernels`` or ``import microrl.losses`` stays free of transformers, peft and
accelerate (docs/README.md lists every package and what it holds)::

    from microrl import ActorEngine, ActorConfig
    engine = ActorEngine(model, ActorConfig(micro_batch_size=8))
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from pkgutil import extend_path

# microrl.engine, .kernels, .losses and .configs live in their own directories of the source tree
# (pyproject.toml maps them); this lets a copy of this directory on sys.path (a checkout's root as
# the working directory) still find them where pip installed them.
__path__ = extend_path(__path__, __name__)

try:
    __version__ = version("microrl")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

# name -> module it comes from
_API = {
    "ActorEngine": "microrl.engine",
    "CriticEngine": "microrl.engine",
    "Engine": "microrl.engine",
    "RewardModelEngine": "microrl.engine",
    "ActorConfig": "microrl.configs",
    "CriticConfig": "microrl.configs",
    "EngineConfig": "microrl.configs",
    "LoraConfig": "microrl.configs",
    "OptimConfig": "microrl.configs",
    "PolicyLossConfig": "microrl.losses",
    "HFRollout": "microrl.rollout",
    "VLLMRollout": "microrl.rollout",
    "Rollout": "microrl.rollout",
    "SamplingParams": "microrl.rollout",
    "make_rollout_backend": "microrl.rollout",
    "MemoryEstimate": "microrl.engine",
    "estimate_memory": "microrl.engine",
    "fused_linear_logprob": "microrl.kernels",
}

__all__ = ["__version__", *sorted(_API)]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'microrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
