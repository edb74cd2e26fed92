"""Sampling from the policy into the engine's batch layout (docs/rollouts.md, docs/async.md).

``weights/``: how trained weights reach a sampler; ``worker/``, ``vllm_plugin/``: code run in other
processes. Names load on first use: vLLM loads ``vllm_plugin`` without the engine.
"""

from __future__ import annotations

import importlib
import warnings

# name -> the module it comes from
_API = {
    "Rollout": "microrl.rollout.base",
    "RolloutBackend": "microrl.rollout.base",
    "SamplingParams": "microrl.rollout.base",
    "Samples": "microrl.rollout.layout",
    "build_rollout": "microrl.rollout.layout",
    "merge_rollouts": "microrl.rollout.merge",
    "select_groups": "microrl.rollout.merge",
    "turn_terminators": "microrl.rollout.turns",
    "HFRollout": "microrl.rollout.samplers.hf",
    "VLLMRollout": "microrl.rollout.samplers.vllm",  # vllm: an optional dependency
    "make_rollout_backend": "microrl.rollout.factory",
    "Job": "microrl.rollout.sampler",
    "SamplerOptions": "microrl.rollout.sampler",
    "AsyncRollout": "microrl.rollout.samplers.hf_worker",
    "AsyncRolloutPool": "microrl.rollout.samplers.hf_pool",
    "VLLMServerRollout": "microrl.rollout.samplers.vllm_servers",
    "make_sampler": "microrl.rollout.factory",
    "InProcessSampler": "microrl.rollout.samplers.in_process",
    "Sampler": "microrl.rollout.sampler",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


def moved_here(old: str):
    """The ``__getattr__`` of ``old``, a package that moved here (with a ``DeprecationWarning``)."""

    def reexport(name: str):
        if name not in _API:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old} is deprecated: import {name} from microrl.rollout", DeprecationWarning, 2
        )
        return __getattr__(name)

    return reexport
