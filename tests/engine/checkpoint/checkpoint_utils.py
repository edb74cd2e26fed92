"""The actor the checkpoint and export tests save, load and export (test_checkpoint.py,
test_export.py)."""

from __future__ import annotations

from distributed_utils import actor_config, tiny_model

from microrl.configs.engine import LoraConfig, OptimConfig
from microrl.engine import ActorEngine

ADAM = OptimConfig(
    name="adamw",
    lr=1e-2,
    warmup_steps=2,
    schedule="cosine",
    total_steps=8,
    grad_clip=1.0,
    weight_decay=0.01,
)


def actor_engine(lora: int = 4, *, seed: int = 0, **overrides) -> ActorEngine:
    """An eager-head actor on ``tiny_model(seed)`` with AdamW, a schedule and clipping (``ADAM``
    unless ``optim`` is given); LoRA has dropout, so a resume must restore the RNG."""
    overrides.setdefault("optim", ADAM)
    config = actor_config(lora=0, fused=False, **overrides)
    if lora:
        config.lora = LoraConfig(rank=lora, alpha=8.0, dropout=0.1)  # dropout: RNG matters
    return ActorEngine(tiny_model(seed), config)
