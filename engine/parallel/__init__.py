"""Parallel training (docs/engine.md): the process group and device mesh, FSDP2 data parallelism
(``distributed``), tensor parallelism (``tensor_parallel`` and its layers, ``tp_layers``),
Ulysses sequence parallelism (``sequence_parallel`` and its attention, ``ulysses_attention``),
the per-sequence attention of packed rows it shares with one process (``varlen_attention``),
FSDP2's CPU offload of parameters, gradients and optimizer state (``cpu_offload``), rank-0
loading of large checkpoints (``materialize``) and the paths every node must see (``nodes``).

A leaf: the engine imports it, and it imports no module of the engine root
(tests/test_imports.py)."""
