"""Parallel training (docs/engine.md): FSDP2 (``distributed``), tensor parallelism
(``tensor_parallel``, ``tp_layers``), Ulysses sequence parallelism (``sequence_parallel``,
``ulysses_attention``), per-sequence attention of packed rows (``varlen_attention``), CPU offload
(``cpu_offload``), rank-0 loading (``materialize``) and paths every node must see (``nodes``).

A leaf: it imports no module of the engine root (tests/test_imports.py).
"""
