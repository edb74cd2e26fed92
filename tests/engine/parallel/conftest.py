"""Tests of ``microrl.engine.parallel`` (engine/parallel/): FSDP2 data parallelism, tensor and
Ulysses sequence parallelism against one process on 2 or 4 gloo ranks (each launch runs a file's
own rank side), optimizer offload, runs across nodes, and a clean exit of an engine-started group.

Helper: ``sequence_parallel_utils`` (engines, per-step records and their comparison), here. The
ranks put tests/ on ``sys.path`` themselves, for ``distributed_utils`` and ``export_utils``.
"""
