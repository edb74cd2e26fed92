"""Checkpoints and exports (docs/checkpoints.md).

:mod:`~microrl.engine.checkpoint.save_load` writes and restores an engine's training state
atomically; :mod:`~microrl.engine.checkpoint.export` writes the trained model in the ecosystem's
formats (a merged transformers model, a PEFT adapter). The other modules are their parts: the
directory swap (``atomic_io``), the ranks' agreement on an outcome (``agreement``), the state-dict
layout (``state_dicts``) and the RNG streams (``rng``).
"""

from microrl.engine.checkpoint.export import export_merged_model, export_peft_adapter
from microrl.engine.checkpoint.save_load import (
    CheckpointAbortedError,
    CheckpointError,
    CheckpointInfo,
    is_complete_checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)

__all__ = [
    "CheckpointAbortedError",
    "CheckpointError",
    "CheckpointInfo",
    "export_merged_model",
    "export_peft_adapter",
    "is_complete_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
]
