"""A tiny vision-language policy on the toy tokenizer, for the rollout and recipe tests.

tests/engine/vision_utils.py builds the engine's tiny Qwen-VL models on a bare id space; the
samplers and recipes need a tokenizer and an image processor too: here a tiny Qwen2-VL on the toy
character tokenizer (its vocabulary, its image tokens) with transformers' PIL image processor,
built in memory or saved as a local checkpoint. No download.
"""

from __future__ import annotations

import torch
from PIL import Image
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from microrl.run.toy_model import build_tokenizer

#: The toy tokenizer's Qwen-VL image tokens.
IMAGE_TEXT_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
#: One image as a prompt writes it: the placeholder between the vision start and end tokens.
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def toy_vlm(seed: int = 0):
    """``(model, tokenizer, image_processor)``: a 2-layer, hidden-32 Qwen2-VL with a one-block
    vision tower, and a processor of 2-pixel patches merged 2x2 (an 8x8 picture: 4 features)."""
    tokenizer = build_tokenizer(extra_tokens=IMAGE_TEXT_TOKENS)
    start, image, end = tokenizer.convert_tokens_to_ids(IMAGE_TEXT_TOKENS)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters=rope,
        **ids,
    )
    vision = dict(
        depth=1,
        embed_dim=16,
        hidden_size=32,
        mlp_ratio=2,
        num_heads=2,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=image,
        video_token_id=tokenizer.unk_token_id,  # no video token in the toy vocabulary
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.update(**ids)
    processor = Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=4 * 4, max_pixels=16 * 16
    )
    return model, tokenizer, processor


def save_tiny_vlm(path, seed: int = 0):
    """:func:`toy_vlm` saved as a local checkpoint at ``path`` (model, tokenizer, image
    processor: what ``ImageEncoder.from_pretrained`` and the recipes read); returns ``path``."""
    model, tokenizer, processor = toy_vlm(seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB picture."""
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())
