"""The toy vision-language base (microrl/run/toy_vision.py): it saves as a normal checkpoint that
the image encoder, ``has_vision_config`` and the engine read back, and its warm start on the toy
vision task (task.name=digits) takes the greedy held-out accuracy from nothing to a clear share.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from microrl.configs import ActorConfig, LoraConfig
from microrl.configs.run import ModelConfig, TaskConfig, WarmStartConfig
from microrl.engine import ActorEngine
from microrl.engine.vision import has_vision_config
from microrl.rollout.images import ImageEncoder
from microrl.run import Dist, prepare_base_model
from microrl.run import toy_vision as tv
from microrl.run.toy_model import load_tokenizer
from microrl.tasks import make_task
from microrl.tasks.digits import DigitsTask


def test_the_toy_vlm_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    task = DigitsTask(9, 8, seed=0)
    tokenizer = tv.build_vision_tokenizer(task.toy_alphabet)
    model = tv.build_vision_model(ModelConfig(path=str(tmp_path)), tokenizer)
    assert (
        model.config.text_config.hidden_size // model.config.text_config.num_attention_heads == 32
    )
    tv.save_toy_vision(model, tokenizer, tv.build_image_processor(task.image_size), tmp_path)

    assert has_vision_config(tmp_path)
    encoder, loaded = ImageEncoder.from_pretrained(tmp_path), load_tokenizer(tmp_path)
    assert encoder.image_token_id == loaded.convert_tokens_to_ids("<|image_pad|>")
    assert encoder.merge_size == 2
    problems = task.eval_problems()[:3]
    batch = tv.image_sft_batch(encoder, loaded, problems)
    image = batch["input_ids"] == encoder.image_token_id
    assert image.sum(-1).tolist() == [9, 9, 9]  # 24x24 px: a 6x6 patch grid, 2x2 merged
    assert not (image & batch["loss_mask"]).any()
    assert batch["image_grid_thw"][:, 0].tolist() == [[1, 6, 6]] * 3

    engine = ActorEngine(str(tmp_path), ActorConfig(micro_batch_size=2, lora=LoraConfig(rank=0)))
    logprobs = engine.infer_batch(batch)["logprobs"]
    assert logprobs.shape == batch["input_ids"].shape and torch.isfinite(logprobs).all()
    # The engine scores what the model itself computes for each row alone (mRoPE included).
    ids = batch["input_ids"][:1, : int(batch["attention_mask"][0].sum())]
    with torch.no_grad():
        logits = engine.model(
            input_ids=ids,
            pixel_values=batch["pixel_values"][0],
            image_grid_thw=batch["image_grid_thw"][0],
            mm_token_type_ids=(ids == encoder.image_token_id).int(),
        ).logits
    direct = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    torch.testing.assert_close(logprobs[0, 1 : ids.shape[1]], direct, rtol=1e-4, atol=1e-4)


def test_the_warm_start_teaches_the_toy_vision_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tv, "WARM_START_EVAL_PROMPTS", 32)  # cheaper checks
    task_cfg = TaskConfig(name="digits", max_operand=3, eval_size=40)
    task = make_task(task_cfg)
    held_out = task.eval_problems()
    # The same freshly built model, before any step: no answer right.
    tokenizer = tv.build_vision_tokenizer(task.toy_alphabet)
    fresh = tv.build_vision_model(ModelConfig(path=str(tmp_path)), tokenizer)
    encoder = ImageEncoder(
        tv.build_image_processor(task.image_size), fresh.config.image_token_id, 2
    )
    before = tv.accuracy_on(fresh, encoder, tokenizer, task, held_out, 4)

    warm_start = WarmStartConfig(max_steps=200, batch_size=32, eval_every=25, target_accuracy=0.6)
    cfg = ModelConfig(path=str(tmp_path / "base"), build_toy=True, warm_start=warm_start)
    lines: list[str] = []
    tokenizer, path = prepare_base_model(cfg, task_cfg, Dist(), 4, log=lines.append)
    assert "Qwen2VLForConditionalGeneration" in lines[0]
    encoder = ImageEncoder.from_pretrained(path)
    from transformers import AutoModelForImageTextToText

    trained = AutoModelForImageTextToText.from_pretrained(path)
    after = tv.accuracy_on(trained, encoder, tokenizer, task, held_out, 4)
    assert before <= 0.1 and after >= 0.4, (before, after, lines)
    assert task.sample(random.Random(0), 1)[0].images  # the task's rows carry their image
