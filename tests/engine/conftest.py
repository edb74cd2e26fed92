"""Tests of ``microrl.engine`` (engine/): the engines, their micro-batching, packing, heads and
log-probs, training steps, LoRA, sequence-level roles and host syncs; data and tensor parallelism
(engine/parallel/: FSDP2 and TP on 2 or 4 gloo ranks, each launch running a file's own rank side);
checkpoints and exports (engine/checkpoint/: save/load, the atomic directory swap, faults on one
rank, ``test_export.py``); device selection and a clean exit.

Helpers: ``engine_utils`` (tiny models, batches, row-by-row references) and ``distributed_utils``
(rank launches, DP references) at tests/, which other folders share.
"""
