"""The vllm rollout backend with image prompts: a tiny Qwen2-VL sampled by vLLM on the CPU.

Its own module (one vLLM engine per module: closing a second in-process engine ends vLLM's
process-wide groups, see test_rollout_vllm.py). This machine has no torchvision, which vLLM's
Qwen-VL code needs: the test-only stand-ins of tests/rollout/samplers/vllm_vision_shim.py replace
the two processor constructions that need it; the model, its vision tower and vLLM's multimodal
processing run for real. Without them the backend refuses at start (tested here too).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.rollout import VLLMConfig
from microrl.engine import ActorEngine
from microrl.rollout import SamplingParams
from microrl.rollout.images import ImageEncoder

pytestmark = pytest.mark.slow

TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# vLLM's CPU kernels and the engine's float32 round differently (attention, the vision tower's
# matmuls); the text path's bound (test_rollout_vllm.py) holds with images too.
LOGPROB_ATOL = 1e-4


def tiny_qwen2_vl(tokenizer) -> Qwen2VLForConditionalGeneration:
    """2 text layers with 32-wide heads (vLLM's CPU attention), a one-block 32-wide vision tower
    with 14-pixel patches and a 2x2 merge (Qwen2-VL's own sizes)."""
    torch.manual_seed(0)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, vocab_size=len(tokenizer), rope_parameters=rope,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = dict(
        depth=1, embed_dim=32, hidden_size=64, num_heads=1, mlp_ratio=2, patch_size=14,
        temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
    )  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2VLForConditionalGeneration(config).float()
    # As a trained VLM, it (almost) never samples a placeholder (the engine refuses placeholders
    # without pixels): their logits are 0 while the others' spread ~5 (std).
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        model.lm_head.weight[list(ids.values())] = 0.0
    return model


def picture(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.fixture(scope="module")
def parts():
    from microrl.run.toy_model import build_tokenizer

    tokenizer = build_tokenizer(extra_tokens=TOKENS)
    model = tiny_qwen2_vl(tokenizer)
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 84)
    encoder = ImageEncoder(processor, model.config.image_token_id, merge_size=2)
    engine = ActorEngine(model, ActorConfig(micro_batch_size=8, optim=OptimConfig(lr=5e-2)))
    return engine, tokenizer, encoder


def _config() -> VLLMConfig:
    return VLLMConfig(max_model_len=512, kv_cache_memory_mb=64, enforce_eager=True)


@pytest.fixture(scope="module")
def rollout(parts, tmp_path_factory):
    from vllm_vision_shim import without_torchvision

    from microrl.rollout.samplers.vllm import VLLMRollout

    engine, tokenizer, encoder = parts
    with without_torchvision():
        backend = VLLMRollout(
            engine, tokenizer, _config(), image_encoder=encoder,
            workdir=str(tmp_path_factory.mktemp("vllm-vision")),
        )  # fmt: skip
        yield backend
        backend.close()


def test_refused_at_start_without_torchvision(parts, monkeypatch):
    """Without the stand-ins, and without torchvision, the backend says why before starting."""
    from microrl.rollout.samplers import vllm_images
    from microrl.rollout.samplers.vllm import VLLMRollout

    engine, tokenizer, encoder = parts
    monkeypatch.setattr(vllm_images.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"rollout\.backend=vllm .*torchvision"):
        VLLMRollout(engine, tokenizer, _config(), image_encoder=encoder)


def test_image_samples_score_at_the_engines_logprobs(rollout, parts):
    engine, tokenizer, _ = parts
    images = [[picture(40, 30, 0)], [], [picture(60, 28, 1), picture(28, 28, 2)]]
    prompts = [f"1{IMAGE}2=", "3+4=", f"{IMAGE}5{IMAGE}="]
    params = SamplingParams(num_samples=2, temperature=0.7, max_new_tokens=5, seed=3)
    result = rollout.generate(prompts, params, images=images)
    batch = result.batch
    assert batch.batch_size == torch.Size([6])
    vision = torch.tensor([tokenizer.convert_tokens_to_ids(t) for t in TOKENS])
    sampled = torch.where(batch["loss_mask"], batch["input_ids"], -1)
    assert not torch.isin(sampled, vision).any()
    assert batch["image_grid_thw"].shape[1] == 2  # the two-image prompt's rows
    assert batch["loss_mask"].any(-1).all()
    # The trainer scores the rows with its own pixels: the sampler's log-probs agree.
    scored = batch.clone()
    scored["temperature"] = torch.full((len(scored),), params.temperature)  # the sampling one
    expected = engine.infer_batch(scored)["logprobs"].cpu()
    mask = batch["loss_mask"]
    diff = ((batch["rollout_logprobs"] - expected).abs() * mask).max().item()
    assert diff <= LOGPROB_ATOL, f"max |Δlogprob| {diff:.2e}"
    # The pixels matter: other pixels in the same layout score the same tokens otherwise.
    image_rows = batch["image_grid_thw"][:, 0, 0] > 0
    blind = scored.clone()
    blind["pixel_values"] = torch.rand_like(blind["pixel_values"])
    moved = (engine.infer_batch(blind)["logprobs"].cpu() - expected).abs() * mask
    assert moved[image_rows].max().item() > 100 * LOGPROB_ATOL


def test_a_synced_update_reaches_the_image_samples(rollout, parts):
    """One optimizer step, pushed in place (the vision-language names mapped by vLLM's loader):
    vLLM's image samples score at the updated engine's log-probs again."""
    engine, _, _ = parts
    images = [[picture(40, 30, 4)], [picture(28, 56, 5)]]
    params = SamplingParams(num_samples=2, temperature=1.0, max_new_tokens=4, seed=7)
    before = rollout.generate([f"{IMAGE}1=", f"2{IMAGE}"], params, images=images).batch
    batch = before.clone()
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"].cpu()
    batch["advantages"] = batch["loss_mask"].float()
    assert engine.train_batch(batch)["step_skipped"] == 0
    rollout.sync(engine)
    after = rollout.generate([f"{IMAGE}1=", f"2{IMAGE}"], params, images=images).batch
    expected = engine.infer_batch(after)["logprobs"].cpu()
    mask = after["loss_mask"]
    assert ((after["rollout_logprobs"] - expected).abs() * mask).max().item() <= LOGPROB_ATOL
    stale = engine.infer_batch(before)["logprobs"].cpu() - before["rollout_logprobs"]
    assert (stale.abs() * before["loss_mask"]).max().item() > 100 * LOGPROB_ATOL  # it moved


# Last in the module: vLLM's in-process engines share its process-global parallel groups, which
# closing this second engine destroys; the module's engine samples no more after it.
def test_lora_adapter_serves_the_image_samples(parts, tmp_path):
    """A LoRA policy (the base exported once, the adapter served as a LoRARequest): after a
    step and a sync, vLLM's image samples score at the engine's log-probs."""
    from vllm_vision_shim import without_torchvision

    from microrl.rollout.samplers.vllm import VLLMRollout

    _, tokenizer, encoder = parts
    engine = ActorEngine(
        tiny_qwen2_vl(tokenizer),
        ActorConfig(micro_batch_size=8, optim=OptimConfig(lr=5e-2), lora=LoraConfig(rank=8)),
    )
    images = [[picture(40, 30, 4)], [picture(28, 56, 5)]]
    params = SamplingParams(num_samples=2, temperature=1.0, max_new_tokens=4, seed=7)
    with without_torchvision():
        rollout = VLLMRollout(
            engine, tokenizer, _config(), image_encoder=encoder, workdir=str(tmp_path)
        )
        try:
            batch = rollout.generate([f"{IMAGE}1=", f"2{IMAGE}"], params, images=images).batch
            batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"].cpu()
            batch["advantages"] = batch["loss_mask"].float()
            assert engine.train_batch(batch)["step_skipped"] == 0
            rollout.sync(engine)
            after = rollout.generate([f"{IMAGE}1=", f"2{IMAGE}"], params, images=images).batch
        finally:
            rollout.close()
    expected = engine.infer_batch(after)["logprobs"].cpu()
    diff = ((after["rollout_logprobs"] - expected).abs() * after["loss_mask"]).max().item()
    assert diff <= LOGPROB_ATOL, f"max |Δlogprob| {diff:.2e}"
