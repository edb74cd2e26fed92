"""Image prompts: the one preprocessing path the trainer and every sampler share.

A prompt with images is a text in which each image stands as one image placeholder token (the
Qwen-VL chat templates' ``<|image_pad|>``, between ``<|vision_start|>`` and ``<|vision_end|>``)
plus its images, in order. :meth:`ImageEncoder.encode` turns such prompts into what every backend
samples from and the engine scores: the token ids with each placeholder repeated once per image
feature (``t * h * w / merge**2``) and the image processor's ``(pixel_values [p, D],
image_grid_thw [n, 3])`` per prompt, laid out per row by :func:`~microrl.engine.vision.pad_images`.

The image processor is always transformers' PIL backend (``backend="pil"``): it needs no
torchvision and computes the same pixels on every machine, so a sampler and the trainer that
read one checkpoint never disagree on preprocessing (docs/rollouts.md#images).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ImageEncoder", "ImagePrompts", "bounded_size", "check_image_prompts", "problem_images"]


@dataclass
class ImagePrompts:
    """Encoded image prompts, one entry per prompt.

    ``ids``: token ids, placeholders expanded; ``images``: ``(pixel_values [p, D],
    image_grid_thw [n, 3])`` or None for a prompt without images; ``raw``: the PIL images as given
    (backends that preprocess themselves, vLLM, get these)."""

    ids: list[list[int]]
    images: list[tuple[torch.Tensor, torch.Tensor] | None]
    raw: list[list[Any]]


@dataclass(frozen=True)
class ImageEncoder:
    """A checkpoint's image processor and the two facts of its config the token layout needs."""

    image_processor: Any
    image_token_id: int
    merge_size: int

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, max_pixels: int | None = None, key: str = "max_pixels"
    ) -> ImageEncoder:
        """The encoder of a local vision-language checkpoint (its ``preprocessor_config.json``).

        ``max_pixels``: the most pixels an image keeps, applied as the Qwen-VL image processor
        applies its own ``max_pixels`` (``size["longest_edge"]``: an image above it is resized,
        aspect kept, to a multiple of ``patch_size x merge_size`` pixels per side that fits);
        the checkpoint's own bound stays when it is smaller; None keeps it. The bound is part of
        the processor, so vLLM, given it saved beside the weights, sizes images the same.
        Raises ``ValueError`` naming ``key`` for a bound below one image token or below the
        processor's ``min_pixels``."""
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(path)
        token = getattr(config, "image_token_id", None)
        vision = getattr(config, "vision_config", None)
        if token is None or vision is None:
            raise ValueError(f"{path}: not a vision-language checkpoint (no image_token_id)")
        processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        if max_pixels is not None:
            size = bounded_size(processor, max_pixels, key)
            processor = AutoImageProcessor.from_pretrained(path, backend="pil", size=size)
        return cls(processor, int(token), int(getattr(vision, "spatial_merge_size", 1)))

    def encode(
        self, tokenizer, prompts: Sequence[str], images: Sequence[Sequence[Any]]
    ) -> ImagePrompts:
        """Token ids and image tensors of ``prompts[i]`` with ``images[i]`` (PIL images, maybe none).

        Raises ``ValueError`` naming the prompt when its placeholder count and image count differ.
        """
        if len(prompts) != len(images) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(
                f"image prompts must be texts with one image list each, got {len(prompts)} "
                f"prompts and {len(images)} image lists"
            )
        out = ImagePrompts(ids=[], images=[], raw=[])
        for i, (text, row_images) in enumerate(zip(prompts, images, strict=True)):
            ids, encoded = self.encode_ids(list(tokenizer(text)["input_ids"]), row_images, i)
            out.ids.append(ids)
            out.images.append(encoded)
            out.raw.append(list(row_images))
        return out

    def encode_ids(
        self,
        ids: list[int],
        images: Sequence[Any],
        index: int = 0,
        *,
        encoded: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor] | None]:
        """One prompt's token ids (already tokenized, e.g. an episode's rendered first input)
        with ``images``: the ids with the placeholders expanded and ``(pixel_values,
        image_grid_thw)`` (None without images). ``index`` names the prompt in the error.
        ``encoded``: these images' ``(pixel_values, image_grid_thw)`` from an earlier call,
        returned as they are (the same tensors: a group's rows share them)."""
        slots = ids.count(self.image_token_id)
        if slots != len(images):
            raise ValueError(
                f"prompt {index}: {slots} image placeholder tokens but {len(images)} images "
                "(one placeholder per image, as the chat template renders it)"
            )
        if not images:
            return ids, None
        if encoded is None:
            done = self.image_processor(images=list(images), return_tensors="pt")
            encoded = (done["pixel_values"], done["image_grid_thw"].long())
        return self._expand(ids, encoded[1]), encoded

    def _expand(self, ids: list[int], grid: torch.Tensor) -> list[int]:
        """``ids`` with the ``k``-th placeholder repeated as many times as image ``k`` has features."""
        counts = iter((grid.prod(-1) // self.merge_size**2).tolist())
        expanded: list[int] = []
        for token in ids:
            expanded += [token] * (next(counts) if token == self.image_token_id else 1)
        return expanded


def bounded_size(processor: Any, max_pixels: int, key: str = "max_pixels") -> dict[str, int]:
    """A Qwen-VL image processor's ``size`` (``shortest_edge``: its ``min_pixels``,
    ``longest_edge``: its ``max_pixels``) with ``longest_edge`` at most ``max_pixels``.

    Raises:
        ValueError: naming ``key``: ``max_pixels`` below one image token
            (``(patch_size x merge_size)**2`` pixels) or below the processor's ``min_pixels``.
    """
    side = int(getattr(processor, "patch_size", 1)) * int(getattr(processor, "merge_size", 1))
    if not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels < side**2:
        raise ValueError(
            f"{key} must be an int of at least {side**2} pixels (one image token: "
            f"({side} x {side}) pixels, the processor's patch_size x merge_size), got "
            f"{max_pixels!r}"
        )
    lowest, own = processor.size.shortest_edge, processor.size.longest_edge
    if lowest is not None and lowest > max_pixels:
        raise ValueError(
            f"{key}={max_pixels} is below the image processor's min_pixels={lowest} "
            "(size.shortest_edge in preprocessor_config.json): no size fits both"
        )
    bound = max_pixels if own is None else min(own, max_pixels)
    return {"shortest_edge": lowest, "longest_edge": bound}


def check_image_prompts(
    sampler: Any, prompts: Sequence[Any], images: Sequence[Sequence[Any]]
) -> None:
    """``images`` fit ``prompts`` (texts, one image list each) and ``sampler`` (a rollout backend
    or a sampler) has an ``image_encoder``; a ``ValueError`` naming them otherwise."""
    if getattr(sampler, "image_encoder", None) is None:
        raise ValueError(
            f"images were given but this {type(sampler).__name__} has no image_encoder "
            "(the policy is not a vision-language model)"
        )
    if isinstance(images, str) or len(images) != len(prompts):
        raise ValueError(
            f"images must hold one image list per prompt: {len(prompts)} prompts, "
            f"{len(images)} image lists"
        )
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("images go with text prompts (their placeholders), not token ids")


def problem_images(problems: Sequence[Any]) -> list[list[Any]] | None:
    """Each problem's images (its ``images``) for :meth:`~microrl.rollout.RolloutBackend.generate`,
    or None when no problem has any (a text batch: sampled as text, no image keys)."""
    if not any(getattr(p, "images", ()) for p in problems):
        return None
    return [list(p.images) for p in problems]
