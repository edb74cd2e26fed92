"""Tests of ``microrl.engine`` (engine/): the engines, their micro-batching, packing, heads and
log-probs, training steps, LoRA, sequence-level roles, host syncs, offloads, device selection.
Data, tensor and sequence parallelism are in parallel/ (engine/parallel/), checkpoints and exports
in checkpoint/ (engine/checkpoint/).

Helpers: ``sync_utils`` (the host-sync probe), here; ``engine_utils`` (tiny models, batches,
row-by-row references), ``distributed_utils`` (rank launches, DP references) and
``export_utils`` (export checkers) at tests/, which other folders share.
"""
