"""Image prompts: the one preprocessing path the trainer and every sampler share.

A prompt has one placeholder token per image; :meth:`ImageEncoder.encode` repeats each once per
image feature (``t * h * w / merge**2``) and gives ``(pixel_values [p, D], image_grid_thw
[n, 3])`` per prompt, always with transformers' PIL backend, so a sampler and the trainer never
disagree on pixels (docs/rollouts.md#images).
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ImageEncoder", "ImagePrompts", "bounded_size", "check_image_prompts", "problem_images"]


@dataclass
class ImagePrompts:
    """Per prompt: ``ids`` (placeholders expanded), ``images`` (tensors or None), ``raw`` (PIL)."""

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

        ``max_pixels``: the most pixels an image keeps (the processor's ``size["longest_edge"]``,
        the checkpoint's own when smaller; see :func:`bounded_size`, whose ``ValueError`` names
        ``key``); None keeps the checkpoint's."""
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
        """Token ids and image tensors of ``prompts[i]`` with ``images[i]`` (PIL images, maybe none)."""
        if len(prompts) != len(images) or not all(isinstance(p, str) for p in prompts):
            raise ValueError(
                f"image prompts must be texts with one image list each, got {len(prompts)} "
                f"prompts and {len(images)} image lists"
            )
        out = ImagePrompts(ids=[], images=[], raw=[list(row) for row in images])
        for i, (text, row_images) in enumerate(zip(prompts, images, strict=True)):
            ids, encoded = self.encode_ids(list(tokenizer(text)["input_ids"]), row_images, i)
            out.ids.append(ids)
            out.images.append(encoded)
        return out

    def encode_ids(
        self,
        ids: list[int],
        images: Sequence[Any],
        index: int = 0,
        *,
        encoded: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor] | None]:
        """One tokenized prompt with ``images``: the ids, placeholders expanded, and
        ``(pixel_values, image_grid_thw)`` (None without images); ``encoded``: an earlier call's,
        reused (a group's rows share the tensors). ``ValueError`` naming prompt ``index`` when
        placeholders and images differ in number."""
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
    """A Qwen-VL image processor's ``size`` with ``longest_edge`` at most ``max_pixels``;
    ``ValueError`` naming ``key`` below one image token or the processor's ``min_pixels``."""
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
    """``ValueError`` unless ``images`` fit ``prompts`` and ``sampler`` has an ``image_encoder``."""
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
    """Each problem's images for ``generate``, or None when none has any (a text batch)."""
    if not any(getattr(p, "images", ()) for p in problems):
        return None
    return [list(p.images) for p in problems]


def png_base64(image: Any) -> str:
    """A PIL image as base64 PNG text: lossless, so whoever reads it sees the trainer's pixels."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def png_image(data: str) -> Any:
    """The PIL image of :func:`png_base64`'s text."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()  # read now: the buffer goes
    return image
