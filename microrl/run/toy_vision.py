"""The toy vision-language base model, built locally for the toy vision task: nothing is downloaded.

Three parts, saved together as a normal checkpoint (``config.json``, weights, tokenizer,
``preprocessor_config.json``) that :meth:`~microrl.rollout.images.ImageEncoder.from_pretrained`
and :func:`~microrl.engine.vision.has_vision_config` read:

- the toy character tokenizer (:func:`microrl.run.toy_model.build_tokenizer`) with the Qwen-VL
  image tokens (:data:`IMAGE_TOKENS`) as whole tokens;
- transformers' PIL Qwen2-VL image processor sized for the task's tiny images: 4-pixel patches,
  2x2 merge, every image resized to exactly ``image_size`` squared pixels (a 24x24 image: a 6x6
  patch grid, 9 image tokens);
- a tiny Qwen2-VL built from a config: the text part sized like the text toy model
  (:mod:`microrl.run.toy_model`: ``model.hidden_size`` wide, ``model.num_layers`` layers, 32-wide
  heads, so vLLM's CPU build runs it; Qwen2-VL's heads are ``hidden_size / heads`` wide, so it
  has ``hidden_size / head_dim`` of them) and a small vision tower (:data:`VISION_TOWER`).

The warm start (:func:`warm_start_vision`, called by :mod:`microrl.run.base_model`) teaches it
the task with the engine's supervised loss on image rows laid out as every rollout lays them out:
prompt ids from :meth:`ImageEncoder.encode`, pixels by :func:`~microrl.engine.vision.pad_images`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from microrl.configs.run import ModelConfig
from microrl.engine.vision import pad_images
from microrl.rollout import HFRollout
from microrl.rollout.images import ImageEncoder
from microrl.run.dist import Dist
from microrl.run.session import evaluate_accuracy
from microrl.run.toy_model import build_tokenizer
from microrl.run.warm_start import train_to_target
from microrl.tasks.base import Problem

__all__ = [
    "IMAGE_TOKENS",
    "VISION_TOWER",
    "accuracy_on",
    "build_image_processor",
    "build_vision_model",
    "build_vision_tokenizer",
    "image_sft_batch",
    "save_toy_vision",
    "warm_start_vision",
]

#: The Qwen-VL vision tokens, whole tokens of the toy tokenizer (the video pad only fills the
#: config's ``video_token_id``: the toy tasks have no videos).
IMAGE_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 4, 2, 2
#: The vision tower: 2 blocks, 64 wide with two 32-wide heads.
VISION_TOWER = dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2)
# Training prompts whose greedy accuracy stops the warm start: fewer than the text toy's 500, as
# every check runs the vision tower too; its noise (about 0.03) stays below the step between checks.
WARM_START_EVAL_PROMPTS = 200


def build_vision_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """The toy character tokenizer over ``extra_chars`` too, with :data:`IMAGE_TOKENS`."""
    return build_tokenizer(extra_chars, IMAGE_TOKENS)


def build_image_processor(image_size: int) -> Qwen2VLImageProcessorPil:
    """The PIL Qwen2-VL image processor that resizes every image to ``image_size`` squared
    pixels (a multiple of ``patch * merge`` = 8) and cuts it into 4-pixel patches."""
    step = PATCH_SIZE * MERGE_SIZE
    if image_size < step or image_size % step:
        raise ValueError(f"image_size must be a positive multiple of {step}, got {image_size}")
    pixels = image_size * image_size
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        min_pixels=pixels,
        max_pixels=pixels,
    )


def build_vision_model(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerFast
) -> Qwen2VLForConditionalGeneration:
    """A freshly initialised tiny Qwen2-VL sized by ``cfg`` (seeded by ``cfg.seed``)."""
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    if cfg.hidden_size % head_dim or head_dim % 8:
        raise ValueError(
            f"model.hidden_size={cfg.hidden_size} must be a multiple of model.head_dim={head_dim} "
            "(a multiple of 8) for the toy vision-language model (Qwen2-VL's heads are "
            "hidden_size / heads wide)"
        )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in IMAGE_TOKENS}
    if tokenizer.unk_token_id in ids.values():
        raise ValueError(f"the tokenizer lacks the image tokens {IMAGE_TOKENS}")
    half = head_dim // 2  # mRoPE splits each head's rotary pairs over (t, h, w): Qwen's 2:3:3
    section = [half // 4, half - half // 4 - (3 * half // 8), 3 * half // 8]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.hidden_size // head_dim,
        num_key_value_heads=cfg.hidden_size // head_dim,
        max_position_embeddings=cfg.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = dict(
        VISION_TOWER,
        hidden_size=cfg.hidden_size,  # the merger's output: the text model's width
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH,
        spatial_merge_size=MERGE_SIZE,
        in_channels=3,
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):  # built on the CPU: only its generator is forked
        torch.manual_seed(cfg.seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def image_sft_batch(encoder: ImageEncoder, tokenizer, problems: Sequence[Problem]) -> TensorDict:
    """Teacher-forcing rows ``prompt + answer + <eos>`` of image prompts, loss on ``answer +
    <eos>``: the prompt ids and pixels exactly as a rollout encodes them (``[B, T]`` plus
    ``pixel_values`` and ``image_grid_thw``)."""
    if not problems:
        raise ValueError("need at least one problem")
    encoded = encoder.encode(tokenizer, [p.prompt for p in problems], [p.images for p in problems])
    rows, masks = [], []
    for ids, problem in zip(encoded.ids, problems, strict=True):
        answer = tokenizer(problem.answer, add_special_tokens=False)["input_ids"]
        answer = [*answer, tokenizer.eos_token_id]
        rows.append(ids + answer)
        masks.append([0] * len(ids) + [1] * len(answer))
    width, pad = max(len(r) for r in rows), tokenizer.pad_token_id
    batch = TensorDict(
        {
            "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor(
                [[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.bool
            ),
            "loss_mask": torch.tensor(
                [m + [0] * (width - len(m)) for m in masks], dtype=torch.bool
            ),
        },
        batch_size=[len(rows)],
    )
    if any(images is not None for images in encoded.images):
        batch.update(pad_images(encoded.images))
    return batch


def accuracy_on(
    model: Any,
    encoder: ImageEncoder,
    tokenizer,
    task: Any,
    problems: Sequence[Problem],
    max_new_tokens: int,
    dist_info: Dist | None = None,
) -> float:
    """Greedy accuracy of ``model`` (an engine or a causal LM) on ``problems`` (this rank's
    share), sampled by the ``hf`` backend with ``encoder`` as every run samples image prompts."""
    sampler = HFRollout(model, tokenizer, image_encoder=encoder)
    return evaluate_accuracy(sampler, task, problems, dist_info or Dist(), max_new_tokens)


def warm_start_vision(
    cfg: ModelConfig,
    task: Any,
    dist_info: Dist,
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> float:
    """Build the toy vision-language model for ``task`` (its ``toy_alphabet``, ``image_size``),
    train it with supervised steps until its greedy accuracy on training prompts reaches
    ``model.warm_start.target_accuracy``, and save it (weights, image processor, tokenizer last)
    to ``model.path``. Returns that accuracy."""
    tokenizer = build_vision_tokenizer(task.toy_alphabet)
    processor = build_image_processor(task.image_size)
    model = build_vision_model(cfg, tokenizer)
    encoder = ImageEncoder(processor, model.config.image_token_id, MERGE_SIZE)
    held_out = task.eval_problems()
    prompts = encoder.encode(tokenizer, [p.prompt for p in held_out], [p.images for p in held_out])
    longest = max(len(ids) for ids in prompts.ids)
    if longest + max_new_tokens > cfg.max_positions:
        raise ValueError(
            f"model.max_positions must be >= {longest + max_new_tokens} for this task (its "
            f"prompts have {longest} tokens with the image's, plus rollout.max_new_tokens="
            f"{max_new_tokens}), got {cfg.max_positions}"
        )
    return train_to_target(
        model,
        tokenizer,
        cfg,
        task,
        dist_info,
        make_batch=lambda rng, rows: image_sft_batch(encoder, tokenizer, task.sample(rng, rows)),
        check_prompts=WARM_START_EVAL_PROMPTS,
        max_new_tokens=max_new_tokens,
        log=log,
        image_encoder=encoder,
        save_extra=lambda: processor.save_pretrained(cfg.path),
    )


def save_toy_vision(model, tokenizer, processor, path: str | Path) -> None:
    """Write a toy vision-language checkpoint: weights and config, processor, tokenizer last."""
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
