"""Exports (engine/checkpoint/export.py): what an engine writes loads with transformers and peft
and reproduces the engine's outputs.

* Causal LMs: the merged model (``AutoModelForCausalLM``) and the PEFT adapter (``PeftModel`` on
  the base model) give the engine's log-probs to 2e-5; a full fine-tune has no adapter to export.
* Critics and reward models: token / sequence classifiers (``AutoModelForTokenClassification``,
  ``AutoModelForSequenceClassification``), merged and as an adapter on the base loaded as that
  classifier, give the engine's values / scores to 1e-5; a head the classifier cannot hold is
  refused.

Sharded engines gather their shards to export. Those checks run inside the multi-rank scenarios
that train the sharded engines, with the checkers of ``export_utils`` (tests/):
``check_lm_exports`` in tests/engine/parallel/test_distributed.py (FSDP2,
``export_roundtrip_under_fsdp``) and test_tensor_parallel.py (TP=2, ``export``),
``check_sequence_classifier_export`` in tests/engine/test_engine_sequence_distributed.py (a reward
model under FSDP2, ``export_under_fsdp``). That an export never replaces a directory that is not
one is checked with the checkpoints' refusal (``test_checkpoint.py``).
"""

from __future__ import annotations

import distributed_utils
import pytest
import torch
from checkpoint_utils import actor_engine
from engine_utils import make_batch, pair_batch, tiny_model
from export_utils import SCORE_ATOL, check_lm_exports, check_sequence_classifier_export, hf_scores
from peft import PeftModel
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from microrl.configs import CriticConfig, EngineConfig, LoraConfig, OptimConfig
from microrl.engine import CriticEngine, RewardModelEngine
from microrl.engine.checkpoint.export import export_merged_model, export_peft_adapter


# ----------------------------------------------------------------- causal LMs
@pytest.mark.parametrize("lora", [0, 4])
def test_exports_give_the_engine_logprobs(tmp_path, lora):
    engine = actor_engine(lora)
    for seed in range(2):  # LoRA B moves away from zero: the merge is not trivial
        engine.train_batch(distributed_utils.make_batch(seed=seed))
    batch = distributed_utils.make_batch(seed=11)
    check_lm_exports(engine, batch, engine.infer_batch(batch)["logprobs"], tmp_path)
    if not lora:
        with pytest.raises(ValueError, match="no PeftModel"):
            export_peft_adapter(engine.module, tmp_path / "adapter")


def _gathered_elements(monkeypatch) -> list[int]:
    """Records the elements each state-dict gather of the exports returns."""
    from microrl.engine.checkpoint import export

    gathered, real = [], export.get_model_state_dict

    def spy(model, *args, **kwargs):
        state = real(model, *args, **kwargs)
        gathered.append(sum(v.numel() for v in state.values()))
        return state

    monkeypatch.setattr(export, "get_model_state_dict", spy)
    return gathered


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_an_adapter_export_gathers_only_what_trains(tmp_path, monkeypatch, role) -> None:
    """Every LoRA sync to vLLM exports the adapter: gathering the frozen base too cost a 7B's
    15 GB per step. The adapters (and a critic's head) alone are gathered."""
    lora = LoraConfig(rank=4, alpha=8.0)
    if role == "actor":
        engine = actor_engine(4)
    else:
        engine = CriticEngine(tiny_model(), CriticConfig(micro_batch_size=3, lora=lora))
    gathered = _gathered_elements(monkeypatch)
    export_peft_adapter(engine.module, tmp_path / "adapter", peft_model=engine.peft_model)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.module.parameters())
    assert gathered == [trainable] and trainable < total / 4, (gathered, trainable, total)


# ----------------------------------------------------------------- critics and reward models
def _trained(engine_cls, config, batch_fn, steps=2):
    engine = engine_cls(tiny_model(seed=0), config)
    for seed in range(steps):  # LoRA B moves away from zero: the merge is not trivial
        engine.train_batch(batch_fn(seed))
    return engine


@pytest.mark.parametrize("lora", [0, 4])
def test_reward_model_exports_load_as_sequence_classifiers(tmp_path, lora) -> None:
    config = EngineConfig(
        micro_batch_size=4, optim=OptimConfig(lr=1e-2), lora=LoraConfig(rank=lora, alpha=8.0)
    )
    engine = _trained(RewardModelEngine, config, lambda s: pair_batch(3, 10, seed=20 + s))
    batch = pair_batch(3, 10, seed=30)
    expected = engine.infer_batch(batch)["scores"]
    check_sequence_classifier_export(engine, batch, expected, tmp_path / "merged")
    if lora:
        tiny_model(seed=0).save_pretrained(tmp_path / "base")
        base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=1)
        path = export_peft_adapter(
            engine.module, tmp_path / "adapter", peft_model=engine.peft_model
        )
        adapter = PeftModel.from_pretrained(base, path).eval()
        torch.testing.assert_close(hf_scores(adapter, batch), expected, atol=SCORE_ATOL, rtol=0)


@pytest.mark.parametrize("lora", [0, 4])
def test_critic_exports_load_as_token_classifiers(tmp_path, lora) -> None:
    config = CriticConfig(
        micro_batch_size=3, optim=OptimConfig(lr=1e-2), lora=LoraConfig(rank=lora, alpha=8.0)
    )
    engine = _trained(CriticEngine, config, lambda s: make_batch(seed=40 + s))
    batch = make_batch(seed=50)
    expected = engine.infer_batch(batch)["values"]
    mask = batch["attention_mask"]

    def hf_values(model):  # token-aligned: values[b, t] comes from position t - 1
        out = torch.zeros_like(expected)
        for b in range(batch.batch_size[0]):
            cols = mask[b].nonzero().squeeze(1)
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"][b, cols][None]).logits[0, :, 0]
            out[b, cols[1:]] = logits[:-1]
        return out

    merged = AutoModelForTokenClassification.from_pretrained(
        export_merged_model(engine.module, tmp_path / "merged")
    ).eval()
    assert type(merged).__name__ == "Qwen2ForTokenClassification"
    assert merged.score.bias is not None
    torch.testing.assert_close(hf_values(merged), expected, atol=SCORE_ATOL, rtol=0)
    if lora:
        tiny_model(seed=0).save_pretrained(tmp_path / "base")
        base = AutoModelForTokenClassification.from_pretrained(tmp_path / "base", num_labels=1)
        path = export_peft_adapter(
            engine.module, tmp_path / "adapter", peft_model=engine.peft_model
        )
        adapter = PeftModel.from_pretrained(base, path).eval()
        torch.testing.assert_close(hf_values(adapter), expected, atol=SCORE_ATOL, rtol=0)


def test_an_export_the_classifier_cannot_hold_is_refused(tmp_path) -> None:
    """A head whose bias the transformers classifier lacks: a clear error, not a random head."""
    engine = RewardModelEngine(tiny_model(seed=0), EngineConfig())
    head = engine.module.value_head
    engine.module.value_head = torch.nn.Linear(head.in_features, 1)  # with a bias
    with pytest.raises(ValueError, match=r"the trained head has a bias, .*score has none"):
        export_merged_model(engine.module, tmp_path / "m")
    assert not (tmp_path / "m").exists()
