"""Rollouts: sampling responses from the policy into the engine's batch layout (docs/rollouts.md).

One interface, :class:`RolloutBackend`, two backends: ``hf`` (:class:`HFRollout`, transformers
``generate`` on the engine's own model, no extra dependency) and ``vllm`` (:class:`VLLMRollout`,
a colocated ``vllm.LLM`` whose weights are synced from the engine after optimizer steps; the
optional ``vllm`` extra). Both return the same :class:`Rollout`: a token-aligned ``[B, T]``
batch with ``rollout_logprobs``, the decoded texts and the group id of each row.
:class:`AsyncRollout` runs the ``hf`` backend in a worker process for asynchronous RL (jobs
submitted now, collected later, weights pushed and verified; docs/rollouts.md);
:class:`AsyncRolloutPool` runs several, each sampling a part of every job
(:func:`make_async_rollout` picks one of the two by ``num_workers``);
:class:`VLLMServerRollout` is the same for the ``vllm`` backend, sampling on ``vllm serve``
servers (docs/rollouts.md#vllm-servers).
"""

from microrl.engine.rollout.base import Rollout, RolloutBackend, SamplingParams
from microrl.engine.rollout.factory import BACKENDS, make_rollout_backend
from microrl.engine.rollout.hf import HFRollout
from microrl.engine.rollout.layout import Samples, build_rollout, sft_batch
from microrl.engine.rollout.merge import merge_rollouts, select_groups

__all__ = [
    "BACKENDS",
    "AsyncRollout",
    "AsyncRolloutPool",
    "HFRollout",
    "Rollout",
    "RolloutBackend",
    "Samples",
    "SamplingParams",
    "build_rollout",
    "make_async_rollout",
    "make_rollout_backend",
    "merge_rollouts",
    "select_groups",
    "sft_batch",
]


def __getattr__(name: str):
    if name == "AsyncRollout":  # imported on use: torch.multiprocessing, a worker process
        from microrl.engine.rollout.async_rollout import AsyncRollout

        return AsyncRollout
    if name in ("AsyncRolloutPool", "make_async_rollout"):  # imported on use, as AsyncRollout
        from microrl.engine.rollout import async_pool

        return getattr(async_pool, name)
    if name == "VLLMServerRollout":  # imported on use, as VLLMRollout
        from microrl.engine.rollout.vllm_server import VLLMServerRollout

        return VLLMServerRollout
    if name == "VLLMRollout":  # imported on use: vllm is an optional dependency
        from microrl.engine.rollout.vllm import VLLMRollout

        return VLLMRollout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
