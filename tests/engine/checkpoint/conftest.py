"""Tests of ``microrl.engine.checkpoint`` (engine/checkpoint/): save and load in one process, the
atomic directory swap under a kill at each step, faults on one of 2 ranks, and the exports
(merged model, PEFT adapter, classifiers) loaded back with transformers and peft.

Helper: ``checkpoint_utils`` (the actor these tests save), here; ``export_utils`` (export checkers,
shared with the ranks of parallel/) at tests/.
"""
