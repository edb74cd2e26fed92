"""Tests of ``microrl.engine.rollout`` (engine/rollout/): the transformers backend (``HFRollout``,
the rollout layout) and the vLLM backend (vLLM on the CPU: layout, log-probs, weight sync; one
vLLM engine per rank under 2 gloo ranks, opt-in).
"""
