"""Tests of ``microrl.engine.moe`` (engine/moe/): mixture-of-experts models through the engine
(fused head, packing, log-probs and gradients against the models' own code), the router losses
over the whole mini-batch under any split, routing replay and its key, the recorder, bad input,
and what sequence and tensor parallelism do with MoE models. Their 2-rank runs are in
tests/engine/parallel/test_moe_distributed.py, checkpoints and exports in
tests/engine/checkpoint/test_moe_checkpoint.py.

Helper: ``moe_utils`` (tiny Qwen3-MoE, GPT-OSS and OLMoE models, a forced-routing reference), at
tests/.
"""
