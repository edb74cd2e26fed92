"""Export checkers shared by the export tests (tests/engine/checkpoint/test_export.py) and the
multi-rank scenarios that export sharded engines: ``check_lm_exports`` in
tests/engine/parallel/test_distributed.py (FSDP2) and test_tensor_parallel.py (TP=2),
``check_sequence_classifier_export`` in tests/engine/test_engine_sequence_distributed.py (a
reward model under FSDP2). Every rank calls a checker: a sharded engine gathers its shards
collectively.
"""

from __future__ import annotations

from pathlib import Path

import distributed_utils
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from microrl.engine.checkpoint.export import export_merged_model, export_peft_adapter

LOGPROB_ATOL = 2e-5  # fp32: transformers' own forward and head against the engine's
SCORE_ATOL = 1e-5  # fp32: transformers' classifier forward against the engine's value head


def check_lm_exports(
    engine, batch, expected: torch.Tensor, directory: Path, *, rank: int = 0, base=None
):
    """Export ``engine`` (built on ``base()``, by default ``distributed_utils.tiny_model()``)
    under ``directory``: its PEFT adapter when it has LoRA, and the merged model. Rank 0 loads
    them with peft and transformers and checks their log-probs of ``batch`` equal ``expected``.
    Every rank calls it: a sharded engine gathers its shards collectively."""
    base = base or distributed_utils.tiny_model
    mask = batch["attention_mask"].bool()
    adapter = None
    if engine.config.lora.rank:
        adapter = export_peft_adapter(
            engine.module, directory / "adapter", peft_model=engine.peft_model
        )
    merged = export_merged_model(engine.module, directory / "merged")
    if rank != 0:
        return
    if adapter is not None:
        loaded = PeftModel.from_pretrained(base(), adapter).eval()
        torch.testing.assert_close(
            distributed_utils.hf_logprobs(loaded, batch)[mask],
            expected[mask],
            atol=LOGPROB_ATOL,
            rtol=0,
            msg=lambda m: f"PEFT export: {m}",
        )
    full = AutoModelForCausalLM.from_pretrained(merged)
    torch.testing.assert_close(
        distributed_utils.hf_logprobs(full, batch)[mask],
        expected[mask],
        atol=LOGPROB_ATOL,
        rtol=0,
        msg=lambda m: f"merged export: {m}",
    )


def hf_scores(model, batch) -> torch.Tensor:
    """A transformers sequence classifier's score of each row of ``batch``."""
    out = []
    for b in range(batch.batch_size[0]):  # no pad token in the config: one row at a time
        cols = batch["attention_mask"][b].nonzero().squeeze(1)
        with torch.no_grad():
            out.append(model(input_ids=batch["input_ids"][b, cols][None]).logits[0, 0])
    return torch.stack(out)


def check_sequence_classifier_export(
    engine, batch, expected: torch.Tensor, path: Path, *, rank: int = 0
) -> None:
    """Export the merged reward model of ``engine`` to ``path``; rank 0 loads it as a transformers
    sequence classifier and checks its scores of ``batch`` equal ``expected``. Every rank calls
    it: a sharded engine gathers its shards collectively."""
    path = export_merged_model(engine.module, path)
    if rank != 0:
        return
    merged = AutoModelForSequenceClassification.from_pretrained(path).eval()
    assert type(merged).__name__ == "Qwen2ForSequenceClassification"
    torch.testing.assert_close(hf_scores(merged, batch), expected, atol=SCORE_ATOL, rtol=0)
