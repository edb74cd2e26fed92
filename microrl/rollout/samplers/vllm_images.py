"""Image prompts as vLLM takes them: ONE placeholder per image plus the PIL images, expanded
by vLLM and checked against the trainer's (:func:`check_expanded`, docs/rollouts.md#images)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from microrl.rollout.images import ImageEncoder, png_base64

__all__ = [
    "VIDEO_TOKEN",
    "check_expanded",
    "check_tokenizer",
    "check_vision",
    "collapse_placeholders",
    "image_content_parts",
    "image_request",
    "vision_unsupported",
]


def vision_unsupported() -> str | None:
    """Why vLLM cannot sample image prompts here, or None."""
    if importlib.util.find_spec("torchvision") is None:
        return (
            "vLLM's Qwen-VL models need torchvision (vLLM 0.32 imports "
            "transformers.models.qwen2_vl.image_processing_qwen2_vl and builds "
            "Qwen2VLProcessor, whose video processor requires it: 'ModuleNotFoundError: No "
            "module named torchvision'), and torchvision is not installed"
        )
    return None


#: Looked up by vLLM's Qwen-VL processor even for images only.
VIDEO_TOKEN = "<|video_pad|>"


def check_tokenizer(tokenizer) -> None:
    """``<|video_pad|>`` must be in the vocabulary: vLLM 0.32's Qwen-VL processor reads it."""
    if VIDEO_TOKEN not in tokenizer.get_vocab():
        raise ValueError(
            f"rollout.backend=vllm with images needs {VIDEO_TOKEN} in the tokenizer's vocabulary "
            "(vLLM's Qwen-VL processor looks it up even for images; Qwen-VL tokenizers have it)"
        )


def check_vision(tokenizer, sampler: str) -> None:
    """Refuse at start what vLLM cannot sample image prompts with; ``sampler`` names it."""
    if reason := vision_unsupported():
        raise ValueError(
            f"{sampler} cannot sample image prompts here: {reason}. Use rollout.backend=hf for a "
            "vision-language policy on this machine (docs/rollouts.md#images)"
        )
    check_tokenizer(tokenizer)


def collapse_placeholders(
    ids: list[int], grid: torch.Tensor, image_token_id: int, merge_size: int
) -> list[int]:
    """``ids`` with each image's run of placeholders back to one token; ``grid``: the images'
    ``[n, 3]`` ``image_grid_thw``."""
    counts = (grid.prod(-1) // merge_size**2).tolist()
    out: list[int] = []
    i = k = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        if k >= len(counts) or ids[i : i + counts[k]] != [image_token_id] * counts[k]:
            raise ValueError(
                f"image {k}: expected a run of {counts[k] if k < len(counts) else 0} placeholder "
                f"tokens at position {i} (the encoder's layout)"
            )
        out.append(image_token_id)
        i += counts[k]
        k += 1
    if k != len(counts):
        raise ValueError(f"{len(counts)} images but {k} placeholder runs in the prompt")
    return out


def image_request(
    ids: list[int],
    images: tuple[torch.Tensor, torch.Tensor] | None,
    raw: list[Any],
    encoder: ImageEncoder,
) -> dict[str, Any]:
    """One ``TokensPrompt`` for ``vllm.LLM.generate``, with ``multi_modal_data`` for images."""
    if images is None:
        return {"prompt_token_ids": list(ids)}
    collapsed = collapse_placeholders(ids, images[1], encoder.image_token_id, encoder.merge_size)
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": list(raw)}}


def image_content_parts(raw: list[Any]) -> list[dict[str, str]]:
    """One prompt's images as lossless PNG ``data:`` URLs: the server sees the trainer's pixels."""
    urls = (f"data:image/png;base64,{png_base64(image)}" for image in raw)
    return [{"type": "image_url", "url": url} for url in urls]


def check_expanded(ran: list[int], expected: list[int], index: int) -> None:
    """Raise when the prompt vLLM ran is not the trainer's (log-probs of another layout)."""
    if list(ran) != list(expected):
        raise RuntimeError(
            f"prompt {index}: vLLM expanded its image placeholders to {len(ran)} tokens, the "
            f"trainer's image encoder to {len(expected)}: the image processor vLLM read "
            "(preprocessor_config.json beside the exported weights) does not size images as "
            "the trainer's does"
        )
