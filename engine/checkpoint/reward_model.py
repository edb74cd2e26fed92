"""A :class:`~microrl.engine.RewardModelEngine` checkpoint read back as a transformers classifier.

A checkpoint stores only the trained tensors, so the engine's module is rebuilt on the CPU from
the base model, restored in this process alone, and returned as what
:func:`~microrl.engine.checkpoint.export.export_merged_model` would write
(docs/tasks.md#reward-models).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from microrl.configs.engine import LoraConfig
from microrl.engine.checkpoint.export import classifier_state_dict, classifier_target
from microrl.engine.checkpoint.save_load import (
    CONFIG,
    MANIFEST,
    CheckpointError,
    load_checkpoint,
    read_manifest,
)
from microrl.engine.models import ValueModel, decoder_body

__all__ = ["is_engine_checkpoint", "load_reward_model_checkpoint"]

_HEAD = "model.value_head."  # the score head's tensors in a ValueModel checkpoint


def is_engine_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written by ``Engine.save_checkpoint`` (its manifest)."""
    return (Path(path) / MANIFEST).is_file()


def load_reward_model_checkpoint(
    checkpoint: str | os.PathLike,
    base: str | os.PathLike | nn.Module,
    *,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """The ``*ForSequenceClassification`` (``num_labels=1``, eval, CPU, weights in ``dtype``) that a
    ``RewardModelEngine`` checkpoint and its ``base`` causal LM (a local directory, or a fresh model
    LoRA is injected into) make; ``CheckpointError`` for an incomplete checkpoint, one that is not
    a reward model's, or tensors that do not fit ``base``."""
    from transformers import AutoModelForSequenceClassification

    from microrl.engine import setup

    root = Path(checkpoint)
    manifest = read_manifest(root)
    head = {k[len(_HEAD) :]: v for k, v in manifest["tensors"].items() if k.startswith(_HEAD)}
    if set(head) != {"weight"} or head["weight"][0][0] != 1:
        kind = (
            "a critic's (its value head has a bias)" if "bias" in head else "not a reward model's"
        )
        raise CheckpointError(
            f"{root} is {kind}: a RewardModelEngine checkpoint holds a bias-free "
            "Linear(H, 1) score head (model.value_head.weight)"
        )
    saved = json.loads((root / CONFIG).read_text()) or {}
    lora = LoraConfig(**saved.get("lora", {}))
    causal_lm = setup.load_causal_lm(base, torch.float32)
    causal_lm, _ = setup.apply_lora(causal_lm, lora)
    hidden = causal_lm.get_input_embeddings().embedding_dim
    module = ValueModel(decoder_body(causal_lm), hidden, bias=False, sequence_level=True)
    load_checkpoint(root, model=module, rng=False, local=True)  # checks every tensor first
    target = classifier_target(module)
    state = {k: v.detach() for k, v in module.state_dict().items()}
    out = classifier_state_dict(target, module, state)
    del module, state  # the merged tensors in ``out`` are all the classifier needs
    with torch.device("meta"):  # its class, without initialising weights that are replaced
        cls = type(AutoModelForSequenceClassification.from_config(target.config))
    # transformers' own loading from a state dict: no random init, buffers built as from a file.
    model = cls.from_pretrained(None, config=target.config, state_dict=out, dtype=dtype)
    return model.eval()
