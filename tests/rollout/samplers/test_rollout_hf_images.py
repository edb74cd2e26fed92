"""The ``hf`` backend samples image prompts (microrl/rollout/samplers/hf.py ``_sample_images``).

A tiny Qwen2-VL on the toy tokenizer (tests/vlm_utils.py): rows with and without images in one
batch, several samples per prompt, sampled by the model's own ``generate`` from the prompts'
pixels and grids; the engine scores the sampled tokens at the sampler's log-probs.
"""

from __future__ import annotations

import pytest
import torch
from vlm_utils import IMAGE, picture, save_tiny_vlm, toy_vlm

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import ActorEngine
from microrl.rollout import HFRollout, SamplingParams
from microrl.rollout.images import ImageEncoder

# The text path's bound (test_rollout_hf.py's HF_LOGPROB_ATOL): generate's KV-cached forward
# rounds differently from the engine's full-sequence pass, a few 1e-6 measured.
HF_LOGPROB_ATOL = 5e-5
PROMPTS = [f"1{IMAGE}2=", "3+4=", f"{IMAGE}5{IMAGE}="]


def images():
    return [[picture(8, 8, 0)], [], [picture(12, 8, 1), picture(8, 8, 2)]]


def test_image_rollout_is_scored_at_the_samplers_logprobs(tmp_path, intra_op_threads) -> None:
    path = save_tiny_vlm(tmp_path / "vlm")
    _, tokenizer, _ = toy_vlm()
    engine = ActorEngine(str(path), ActorConfig(temperature=0.7, lora=LoraConfig(rank=2)))
    with torch.no_grad():  # a non-trivial adapter: the policy is not the base model
        generator = torch.Generator().manual_seed(1)
        for name, param in engine.module.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    rollout_backend = HFRollout(engine, tokenizer, image_encoder=ImageEncoder.from_pretrained(path))
    params = SamplingParams(num_samples=2, temperature=0.7, max_new_tokens=5, seed=3)
    rollout = rollout_backend.generate(PROMPTS, params, images=images())
    batch = rollout.batch
    assert batch.batch_size == torch.Size([6]) and "pixel_values" in batch
    assert batch["loss_mask"].sum(-1).min() >= 1
    token = rollout_backend.image_encoder.image_token_id
    # the prompts' placeholders, expanded; never one in a response (the sampler bans it)
    assert (batch["input_ids"] == token).sum(-1).tolist() == [4, 4, 0, 0, 10, 10]
    logprobs = engine.infer_batch(batch)["logprobs"]
    mask = batch["loss_mask"]
    worst = (logprobs - batch["rollout_logprobs"])[mask].abs().max().item()
    assert worst <= HF_LOGPROB_ATOL, f"max |rollout - engine| log-prob {worst:.3g}"
    # Seeded: the same samples again
    again = rollout_backend.generate(PROMPTS, params, images=images())
    assert torch.equal(again.batch["input_ids"], batch["input_ids"])


def test_rows_without_images_sample_as_text_prompts() -> None:
    """A batch whose prompts have no images samples as the text path does (same seed, same
    samples, no image keys)."""
    model, tokenizer, processor = toy_vlm()
    token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    backend = HFRollout(model, tokenizer, image_encoder=ImageEncoder(processor, token, 2))
    params = SamplingParams(num_samples=2, max_new_tokens=4, seed=0)
    with_images = backend.generate(["1+2=", "3="], params, images=[[], []])
    text = backend.generate(["1+2=", "3="], params)
    assert "pixel_values" not in with_images.batch
    assert torch.equal(with_images.batch["input_ids"], text.batch["input_ids"])
    torch.testing.assert_close(
        with_images.batch["rollout_logprobs"], text.batch["rollout_logprobs"]
    )
    with pytest.raises(ValueError, match="no image_encoder"):
        HFRollout(model, tokenizer).generate([f"{IMAGE}="], params, images=[[picture(8, 8, 0)]])


def test_a_vision_policy_never_samples_an_image_placeholder() -> None:
    """The placeholder is banned from the sampling, not from the recorded log-probs: with most
    of the mass on it the responses hold none, at the engine's (full distribution's) log-probs."""
    model, tokenizer, processor = toy_vlm()
    token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():  # a large logit for the placeholder on most hidden states
        weight = model.lm_head.weight
        signs = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0)).sign()
        weight[token] = 10 * weight.norm(dim=1).mean() * signs
    engine = ActorEngine(model, ActorConfig())
    backend = HFRollout(engine, tokenizer, image_encoder=ImageEncoder(processor, token, 2))
    params = SamplingParams(num_samples=4, max_new_tokens=6, seed=0)
    rollout = backend.generate(["1+2=", f"{IMAGE}3="], params, images=[[], [picture(8, 8, 0)]])
    batch, mask = rollout.batch, rollout.batch["loss_mask"]
    assert not (mask & (batch["input_ids"] == token)).any()
    assert batch["rollout_logprobs"][mask].mean() < -4  # uniform over the rest: log(1/21) = -3
    worst = (engine.infer_batch(batch)["logprobs"] - batch["rollout_logprobs"])[mask].abs().max()
    assert worst <= HF_LOGPROB_ATOL, f"max |rollout - engine| log-prob {worst:.3g}"


def test_episodes_with_image_prompts_are_scored_at_the_samplers_logprobs() -> None:
    """An episode's first input carries its prompt's images (placeholders expanded, every turn
    sampled with them), observations are text; each row carries its prompt's grid and its
    entry of the pixel store (one per prompt), and the engine scores the turns at the sampler's
    log-probs."""
    from episode_utils import ScriptEnv

    model, tokenizer, processor = toy_vlm()
    token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    engine = ActorEngine(model, ActorConfig(temperature=0.8))
    backend = HFRollout(engine, tokenizer, image_encoder=ImageEncoder(processor, token, 2))
    rollout = backend.run_episodes(
        PROMPTS,
        lambda i: ScriptEnv(["+", "-"], [0.0, 1.0, 0.0], done_at=3),
        SamplingParams(num_samples=2, temperature=0.8, max_new_tokens=3, seed=0),
        max_turns=3,
        max_tokens=16,
        images=images(),
    )
    batch = rollout.batch
    assert rollout.num_turns.min() > 1 and batch.batch_size == torch.Size([6])
    assert (batch["input_ids"] == token).sum(-1).tolist() == [4, 4, 0, 0, 10, 10]
    assert batch["image_grid_thw"][4].tolist() == [[1, 4, 6], [1, 4, 4]]
    assert batch["image_grid_thw"][2].abs().sum() == 0
    # A prompt's images are encoded once: its two episodes share one entry of the store.
    assert batch["image_index"].tolist() == [0, 0, -1, -1, 1, 1]
    assert batch["pixel_values"].shape[0] == 2
    mask = batch["loss_mask"]
    worst = (engine.infer_batch(batch)["logprobs"] - batch["rollout_logprobs"])[mask].abs().max()
    assert worst <= HF_LOGPROB_ATOL, f"max |rollout - engine| log-prob {worst:.3g}"
    with pytest.raises(ValueError, match="one image list per prompt: 3 prompts, 1 image lists"):
        backend.run_episodes(
            PROMPTS, ScriptEnv, SamplingParams(), max_turns=1, max_tokens=4, images=[[]]
        )
