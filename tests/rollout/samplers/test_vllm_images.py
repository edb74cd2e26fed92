"""Image prompts as vLLM takes them (microrl/rollout/samplers/vllm_images.py), without starting vLLM:
placeholders collapsed back to one per image, the ``TokensPrompt`` dict, lossless image URLs,
the checks of the prompt vLLM ran and of the tokenizer, and the refusal without torchvision."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from microrl.rollout.images import ImageEncoder
from microrl.rollout.samplers import vllm_images
from microrl.run.toy_model import build_tokenizer

TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _encoder():
    tokenizer = build_tokenizer(extra_tokens=TOKENS)
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    )
    token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return ImageEncoder(processor, token, merge_size=2), tokenizer


def _picture(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_requests_hold_one_placeholder_per_image_and_the_images():
    encoder, tokenizer = _encoder()
    images = [[_picture(16, 16, 0), _picture(32, 16, 1)], []]
    prompts = [f"1{IMAGE}{IMAGE}2=", "3+4="]
    encoded = encoder.encode(tokenizer, prompts, images)
    assert encoded.ids[0].count(encoder.image_token_id) > 2  # the encoder expanded them
    requests = [
        vllm_images.image_request(ids, pair, raw, encoder)
        for ids, pair, raw in zip(encoded.ids, encoded.images, encoded.raw, strict=True)
    ]
    # What the tokenizer makes of the prompt text: one placeholder per image.
    assert requests[0]["prompt_token_ids"] == tokenizer(prompts[0])["input_ids"]
    assert requests[0]["multi_modal_data"]["image"] == images[0]
    assert requests[1] == {"prompt_token_ids": encoded.ids[1]}  # no images: a text prompt


def test_collapse_refuses_a_layout_that_is_not_the_encoders():
    grid = torch.tensor([[1, 4, 4]])  # 4 features
    with pytest.raises(ValueError, match="image 0: expected a run of 4"):
        vllm_images.collapse_placeholders([5, 9, 9, 9, 6], grid, 9, 2)
    with pytest.raises(ValueError, match="2 images but 1 placeholder runs"):
        vllm_images.collapse_placeholders([9] * 4, torch.tensor([[1, 4, 4]] * 2), 9, 2)


def test_content_parts_carry_the_exact_pixels():
    image = _picture(24, 16, 3)
    (part,) = vllm_images.image_content_parts([image])
    assert part["type"] == "image_url"
    header, data = part["url"].split(",", 1)
    assert header == "data:image/png;base64"
    decoded = Image.open(io.BytesIO(base64.b64decode(data)))
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


def test_check_expanded_and_tokenizer():
    vllm_images.check_expanded([1, 9, 9, 2], [1, 9, 9, 2], 0)
    with pytest.raises(RuntimeError, match=r"prompt 3: vLLM expanded .* to 3 tokens"):
        vllm_images.check_expanded([1, 9, 2], [1, 9, 9, 2], 3)
    vllm_images.check_tokenizer(build_tokenizer(extra_tokens=TOKENS))
    with pytest.raises(ValueError, match=r"<\|video_pad\|>"):
        vllm_images.check_tokenizer(build_tokenizer(extra_tokens=TOKENS[:3]))


def test_vision_unsupported_names_torchvision(monkeypatch):
    monkeypatch.setattr(vllm_images.importlib.util, "find_spec", lambda name: None)
    assert "torchvision" in vllm_images.vision_unsupported()
