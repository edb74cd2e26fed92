"""Building an engine prints nothing about padding: the fused-head probe (engine/models.py) calls
the model with an all-ones attention mask, so GPT-2-style models do not warn that its token ids
may be padded."""

from __future__ import annotations

import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from microrl.configs import ActorConfig
from microrl.engine import ActorEngine

PADDING_WARNING = "attention_mask"


def _transformers_warnings(run) -> list[str]:
    """The messages transformers logs while ``run()`` runs (its once-only warnings included)."""
    logger = logging.getLogger("transformers")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process memo
    logger.addHandler(handler)
    try:
        run()
    finally:
        logger.removeHandler(handler)
    return [record.getMessage() for record in records]


def test_an_engine_on_gpt2_prints_no_padding_warning() -> None:
    config = GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    # The warning exists, and is caught here: token 0 (the pad id) first, no mask.
    ids = torch.arange(8).unsqueeze(0)
    seen = _transformers_warnings(lambda: model(input_ids=ids))
    assert any(PADDING_WARNING in m for m in seen), seen
    seen = _transformers_warnings(lambda: ActorEngine(model, ActorConfig(micro_batch_size=2)))
    assert not any(PADDING_WARNING in m for m in seen), seen
