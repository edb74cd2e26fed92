"""Tests of ``microrl.engine.rollout`` (engine/rollout/): the transformers backend (``HFRollout``,
the rollout layout), the colocated vLLM backend (vLLM on the CPU: layout, log-probs, weight sync;
one vLLM engine per rank under 2 gloo ranks), multi-turn episodes and the vLLM engine arguments.
Samplers in other processes are tested in tests/remote/.
"""
