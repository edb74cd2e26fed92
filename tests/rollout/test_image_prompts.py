"""Image prompts through the one preprocessing path (microrl/rollout/images.py) into a rollout.

The toy character tokenizer with the Qwen-VL image tokens, transformers' PIL image processor
(4-pixel patches, 2x2 merge) and a backend that returns fixed samples: placeholders expand to one
token per feature, every row of a prompt carries its prompt's pixels and grid, and a prompt whose
placeholders and images disagree is refused naming it.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from microrl.configs.task import ImagesConfig
from microrl.rollout import RolloutBackend, Samples, SamplingParams
from microrl.rollout.images import ImageEncoder
from microrl.run.toy_model import build_tokenizer

IMAGE_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


class FixedBackend(RolloutBackend):
    """Answers every row with "7<eos>" at log-prob -0.5 per token, recording what it was given."""

    def _sample(self, prompt_ids, params):
        return self._fixed(len(prompt_ids) * params.num_samples)

    def _sample_images(self, prompts, params):
        self.seen = prompts
        return self._fixed(len(prompts.ids) * params.num_samples)

    def _fixed(self, rows: int) -> Samples:
        ids = [self.tokenizer.convert_tokens_to_ids("7"), self.tokenizer.eos_token_id]
        return Samples(token_ids=[ids] * rows, logprobs=[[-0.5, -0.5]] * rows)


def encoder_and_tokenizer():
    tokenizer = build_tokenizer(extra_tokens=IMAGE_TOKENS)
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32
    )
    token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return ImageEncoder(processor, token, merge_size=2), tokenizer


def picture(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_rows_carry_their_prompts_expanded_tokens_and_pixels():
    encoder, tokenizer = encoder_and_tokenizer()
    backend = FixedBackend(tokenizer, image_encoder=encoder)
    images = [[picture(16, 16, 0)], [], [picture(24, 16, 1), picture(16, 16, 2)]]
    prompts = [f"1{IMAGE}2=", "3+4=", f"{IMAGE}5{IMAGE}="]
    rollout = backend.generate(prompts, SamplingParams(num_samples=2), images=images)
    batch, token = rollout.batch, encoder.image_token_id
    # 16x16 px -> a 4x4 patch grid -> 4 features; 24x16 -> 4x6 -> 6 features
    assert [ids.count(token) for ids in backend.seen.ids] == [4, 0, 10]
    # One store entry per prompt with images, shared by its group's two rows (-1: no image).
    assert batch["pixel_values"].shape == (2, 16 + 24, 3 * 2 * 4 * 4)
    assert batch["image_index"].tolist() == [0, 0, -1, -1, 1, 1]
    grids = batch["image_grid_thw"]
    assert grids[0].tolist() == grids[1].tolist() == [[1, 4, 4], [0, 0, 0]]
    assert grids[2].abs().sum() == 0 and batch["pixel_values"][0, 16:].abs().sum() == 0
    assert grids[5].tolist() == [[1, 4, 6], [1, 4, 4]]
    assert (batch["input_ids"] == token).sum(-1).tolist() == [4, 4, 0, 0, 10, 10]
    assert not (batch["loss_mask"] & (batch["input_ids"] == token)).any()
    assert rollout.texts == ["7"] * 6
    again = encoder.image_processor(images=images[2], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(batch["pixel_values"][1, :40], again, rtol=0, atol=0)


def test_placeholders_and_images_that_disagree_name_the_prompt():
    encoder, tokenizer = encoder_and_tokenizer()
    backend = FixedBackend(tokenizer, image_encoder=encoder)
    with pytest.raises(ValueError, match="prompt 1: 1 image placeholder tokens but 2 images"):
        backend.generate(
            [f"1{IMAGE}=", f"2{IMAGE}="],
            SamplingParams(),
            images=[[picture(16, 16, 0)], [picture(16, 16, 0)] * 2],
        )


def test_images_for_a_text_backend_are_refused():
    _, tokenizer = encoder_and_tokenizer()
    with pytest.raises(ValueError, match="no image_encoder"):
        FixedBackend(tokenizer).generate(["1="], SamplingParams(), images=[[picture(16, 16, 0)]])


def test_max_pixels_bounds_images_as_the_models_processor_does(tmp_path):
    """``ImageEncoder.from_pretrained(path, max_pixels=)`` (``task.images.max_pixels``): an image
    above the bound is resized as the Qwen-VL processor resizes for its own ``max_pixels``
    (the same grid and pixels), the checkpoint's smaller bound stays, and the bound is saved
    with the processor (what vLLM reads beside the weights)."""
    from transformers import AutoImageProcessor
    from vlm_utils import save_tiny_vlm  # processor: 2-pixel patches, 2x2 merge, <= 16x16 px

    path = save_tiny_vlm(tmp_path / "vlm")
    big = [picture(48, 40, 3)]
    own = ImageEncoder.from_pretrained(path)
    _, (_, own_grid) = own.encode_ids([own.image_token_id], big)
    assert int(own_grid.prod()) * 4 <= 16 * 16  # patches of 2x2 pixels: the checkpoint's bound
    bounded = ImageEncoder.from_pretrained(path, max_pixels=8 * 8)
    ids, (pixels, grid) = bounded.encode_ids([bounded.image_token_id], big)
    reference = Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=4 * 4, max_pixels=8 * 8
    )(images=big, return_tensors="pt")
    assert torch.equal(grid, reference["image_grid_thw"]) and int(grid.prod()) * 4 <= 8 * 8
    torch.testing.assert_close(pixels, reference["pixel_values"], rtol=0, atol=0)
    assert len(ids) == int(grid.prod()) // 4  # one placeholder per feature
    assert ImageEncoder.from_pretrained(path, max_pixels=10**6).image_processor.size == (
        own.image_processor.size
    )  # the checkpoint's smaller bound stays
    bounded.image_processor.save_pretrained(tmp_path / "saved")
    assert AutoImageProcessor.from_pretrained(tmp_path / "saved").size.longest_edge == 8 * 8


def test_bad_max_pixels_names_the_key(tmp_path):
    from vlm_utils import save_tiny_vlm

    from microrl.configs.task import TaskConfig

    path = save_tiny_vlm(tmp_path / "vlm")
    with pytest.raises(
        ValueError, match=r"task.images.max_pixels must be an int of at least 16 pixels"
    ):
        ImageEncoder.from_pretrained(path, max_pixels=15, key="task.images.max_pixels")
    processor = Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=16 * 16
    )
    processor.save_pretrained(path)
    with pytest.raises(ValueError, match=r"task.images.max_pixels=32 is below .* min_pixels=64"):
        ImageEncoder.from_pretrained(path, max_pixels=32, key="task.images.max_pixels")
    with pytest.raises(ValueError, match=r"task.images.max_pixels must be null or an int >= 1"):
        TaskConfig(images=ImagesConfig(max_pixels=0))
    assert TaskConfig().images.max_pixels == 1280 * 28 * 28 and TaskConfig(
        images=ImagesConfig(max_pixels=None)
    )
