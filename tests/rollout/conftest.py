"""Tests of ``microrl.engine.rollout`` (engine/rollout/): the transformers backend (``HFRollout``,
the rollout layout), the vLLM backend (vLLM on the CPU: layout, log-probs, weight sync; one vLLM
engine per rank under 2 gloo ranks), the generation workers and vLLM servers, and the GPU paths
with CUDA monkeypatched (server placement, weight pushes).

Helper: ``route_utils`` (a stand-in socket module for the trainer address).
"""
