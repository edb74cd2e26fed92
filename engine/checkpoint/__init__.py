"""Checkpoints and exports (docs/checkpoints.md): ``save_load`` writes and restores an engine's
training state atomically, ``export`` writes the trained model in the ecosystem's formats; the
rest are their parts (``atomic_io``, ``agreement``, ``state_dicts``, ``rng``).
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
