"""Tiny Qwen-VL models built from configs and image batches for the engine's vision tests.

No download: the models come from transformers configs (one vision block, 2-patch images, a
16-wide tower, the text model of tests/engine_utils.py); images are random patches with their
``(t, h, w)`` grids, laid out with :func:`microrl.engine.vision.pad_images`.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from microrl.engine.vision import pad_images

VOCAB = 128
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 120, 121, 118, 119
MERGE = 2
PATCH_DIM = 3 * 2 * 2 * 2  # channels * temporal patch * patch * patch
TEXT_IDS = 110  # ordinary text tokens are drawn below the special ones

_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
_VISION = dict(
    depth=1,
    hidden_size=16,
    num_heads=2,
    patch_size=2,
    temporal_patch_size=2,
    spatial_merge_size=MERGE,
    in_channels=3,
)
_SPECIAL = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=VIDEO_TOKEN,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
    tie_word_embeddings=False,
)


def tiny_vlm(arch: str = "qwen2_vl", *, seed: int = 0, dtype=torch.float32):
    """A 2-layer, hidden-32 Qwen2-VL / Qwen2.5-VL / Qwen3-VL with a one-block vision tower."""
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    text, vision = dict(_TEXT, rope_parameters=rope), dict(_VISION)
    if arch == "qwen2_vl":
        vision = dict(vision, embed_dim=16, hidden_size=32, mlp_ratio=2)
        model = Qwen2VLForConditionalGeneration(
            Qwen2VLConfig(text_config=text, vision_config=vision, **_SPECIAL)
        )
    elif arch == "qwen2_5_vl":
        vision = dict(vision, out_hidden_size=32, intermediate_size=32, window_size=8)
        vision["fullatt_block_indexes"] = [0]
        model = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_SPECIAL)
        )
    elif arch == "qwen3_vl":
        text["rope_parameters"] = dict(rope, mrope_interleaved=True)
        vision = dict(vision, out_hidden_size=32, intermediate_size=32)
        vision.update(deepstack_visual_indexes=[0], num_position_embeddings=16)
        model = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(text_config=text, vision_config=vision, **_SPECIAL)
        )
    else:
        raise ValueError(arch)
    return model.to(dtype)


def image_row(
    gen: torch.Generator, grids: list[tuple[int, int, int]], prompt: int, response: int
) -> tuple[list[int], int, tuple[torch.Tensor, torch.Tensor] | None]:
    """One row: text, each image as ``<start> <image>*features <end>``, text, then the response.

    Returns the ids, the index where the response starts, and the row's ``(pixel_values,
    image_grid_thw)`` (None without images)."""
    text = lambda n: torch.randint(0, TEXT_IDS, (n,), generator=gen).tolist()  # noqa: E731
    ids = text(2)
    for t, h, w in grids:
        ids += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // MERGE**2) + [VISION_END]
    ids += text(prompt)
    start = len(ids)
    ids += text(response)
    if not grids:
        return ids, start, None
    grid = torch.tensor(grids, dtype=torch.long)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen)
    return ids, start, (pixels, grid)


DEFAULT_ROWS = (
    [(1, 2, 2)],
    [],
    [(1, 4, 2), (1, 2, 2)],
    [(1, 2, 4)],
    [],
    [(1, 4, 4)],
)


def make_image_batch(
    rows: tuple[list[tuple[int, int, int]], ...] = DEFAULT_ROWS,
    *,
    seed: int = 0,
    pad: int = 3,
    dtype: torch.dtype = torch.float32,
) -> TensorDict:
    """Rows with 0, 1 or 2 images, mixed left/right/both padding, actor and critic loss keys
    (``loss_mask`` on the response only: never on an image token)."""
    gen = torch.Generator().manual_seed(seed)
    built = [
        image_row(gen, grids, prompt=1 + b % 3, response=2 + b % 4) for b, grids in enumerate(rows)
    ]
    width = max(len(ids) for ids, _, _ in built) + pad
    B = len(built)
    input_ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.bool)
    loss_mask = torch.zeros_like(mask)
    for b, (ids, start, _) in enumerate(built):
        left = (0, width - len(ids), (width - len(ids)) // 2)[b % 3]
        input_ids[b, left : left + len(ids)] = torch.tensor(ids)
        mask[b, left : left + len(ids)] = True
        loss_mask[b, left + start : left + len(ids)] = True
    images = pad_images([images for _, _, images in built])
    images["pixel_values"] = images["pixel_values"].to(dtype)
    return TensorDict(
        input_ids=input_ids,
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=torch.randn(B, width, generator=gen, dtype=dtype),
        old_logprobs=-torch.rand(B, width, generator=gen, dtype=dtype) * 3,
        old_values=torch.randn(B, width, generator=gen, dtype=dtype),
        returns=torch.randn(B, width, generator=gen, dtype=dtype),
        **images,
        batch_size=[B],
    )
