"""Parallel training (docs/engine.md): the process group and device mesh, FSDP2 data parallelism
(``distributed``), tensor parallelism (``tensor_parallel`` and its layers, ``tp_layers``) and
rank-0 loading of large checkpoints (``materialize``)."""
