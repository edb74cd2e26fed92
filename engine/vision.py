"""Images through the engine: the batch's image keys, checks, mRoPE positions, the vision body.

A vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) reads ``pixel_values`` ``[G, P, D]``,
``image_index`` ``[B]`` and ``image_grid_thw`` ``[B, I, 3]`` (docs/batch.md#images). The 3-D
rotary positions are computed once per mini-batch and travel as the per-token key
:data:`ROPE_KEY` ``[B, T, 3]``. Nothing here imports transformers.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, UnbatchedTensor
from torch import nn

from microrl.engine.vision_layout import (
    IMAGE_GRID_KEY,
    IMAGE_INDEX_KEY,
    IMAGE_KEYS,
    PIXEL_VALUES_KEY,
    from_plain_tensors,
    image_store,
    pad_images,
    to_plain_tensors,
)

__all__ = [
    "IMAGE_GRID_KEY",
    "IMAGE_INDEX_KEY",
    "IMAGE_KEYS",
    "PIXEL_VALUES_KEY",
    "ROPE_KEY",
    "ImageInputs",
    "VisionSpec",
    "body_hidden",
    "config_key",
    "from_plain_tensors",
    "has_vision_config",
    "image_inputs",
    "image_store",
    "model_positions",
    "multimodal_body",
    "pad_images",
    "prepare_batch",
    "refuse_parallel",
    "to_plain_tensors",
    "vision_spec",
]

#: The first transformers whose Qwen-VL bodies take precomputed image features
#: (``mm_encoder_outputs``); 5.17 takes them as an unknown keyword and silently ignores them.
MIN_TRANSFORMERS = "5.18"
#: The engine's mRoPE positions ``[B, T, 3]`` (``(t, h, w)`` per token), computed at the boundary.
ROPE_KEY = "rope_position_ids"


def has_vision_config(model: nn.Module | str | os.PathLike) -> bool:
    """Whether ``model`` (a module or a local checkpoint) declares a vision tower in its config."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError):
            return False  # the loader reports a bad path itself
    else:
        config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None


def refuse_parallel(model: nn.Module | str | os.PathLike, config: object) -> None:
    """Sequence and tensor parallelism do not split images and mRoPE positions yet: a ``ValueError``
    naming the key, before any process group is touched."""
    for name in ("sequence_parallel_size", "tensor_parallel_size"):
        size = getattr(config, name)
        if size > 1 and has_vision_config(model):
            key = config_key(config, name)
            raise ValueError(
                f"{key}={size} is not supported for a vision-language model (its image features "
                f"and 3-D mRoPE positions are not split over ranks); set {key}=1 and scale with "
                "data parallelism"
            )


def config_key(config: object, name: str) -> str:
    """``name`` as the user writes it in a run config: ``actor.<name>`` / ``critic.<name>``."""
    role = type(config).__name__.removesuffix("Config").lower()
    return f"{role}.{name}" if role in ("actor", "critic") else name


def multimodal_body(causal_lm: nn.Module) -> nn.Module | None:
    """The Qwen-VL multimodal body (``causal_lm.model``: tower + language model), or None."""
    if getattr(getattr(causal_lm, "config", None), "vision_config", None) is None:
        return None
    body = getattr(causal_lm, "model", None)
    needed = ("visual", "get_image_features", "get_rope_index", "language_model")
    return body if body is not None and all(hasattr(body, n) for n in needed) else None


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know about a vision-language model: ``body`` (multimodal), ``tower``
    (what ``freeze_vision`` freezes) and its module name, ``merge``, ``patch_dim`` (``D``)."""

    body: nn.Module
    tower: nn.Module
    tower_prefix: str
    image_token_id: int
    merge: int
    patch_dim: int

    def features_per_image(self, grid: torch.Tensor) -> torch.Tensor:
        """``[..., 3]`` grids -> ``[...]`` feature (= placeholder token) counts."""
        return grid.prod(-1) // (self.merge**2)

    def tower_module_names(self, causal_lm: nn.Module) -> list[str]:
        """Every module name inside the vision tower (LoRA leaves them out when frozen)."""
        prefix = self.tower_prefix + "."
        return [n for n, _ in causal_lm.named_modules() if n.startswith(prefix)]

    def placeholder_images(self, device: torch.device) -> ImageInputs:
        """One one-feature image, for a micro-batch without: every rank runs the tower."""
        pixels = torch.zeros(self.merge**2, self.patch_dim, device=device)
        grid = torch.tensor([[1, self.merge, self.merge]], device=device)
        return ImageInputs(pixels, grid, placeholder=True)


def vision_spec(causal_lm: nn.Module) -> VisionSpec | None:
    """The :class:`VisionSpec` of a supported vision-language model, None for a text model;
    ``TypeError`` for a vision tower in a layout the engine does not know."""
    config = getattr(causal_lm, "config", None)
    if getattr(config, "vision_config", None) is None:
        return None
    body = multimodal_body(causal_lm)
    if body is None:
        raise TypeError(
            f"{type(causal_lm).__name__} has a vision_config but not the Qwen-VL layout the "
            "engine supports (model.visual, get_image_features, get_rope_index): Qwen2-VL, "
            "Qwen2.5-VL and Qwen3-VL are"
        )
    if "mm_encoder_outputs" not in inspect.signature(body.forward).parameters:
        import transformers

        raise TypeError(
            f"{type(body).__name__}.forward takes no mm_encoder_outputs in transformers "
            f"{transformers.__version__}: it would drop the image features the engine computes "
            "and train on the placeholder tokens' embeddings instead (the images never seen). "
            f"Vision-language models need transformers >= {MIN_TRANSFORMERS}"
        )
    vision = config.vision_config
    prefix = next(n for n, m in causal_lm.named_modules() if m is body.visual)
    return VisionSpec(
        body=body,
        tower=body.visual,
        tower_prefix=prefix,
        image_token_id=int(config.image_token_id),
        merge=int(vision.spatial_merge_size),
        patch_dim=int(vision.in_channels * vision.temporal_patch_size * vision.patch_size**2),
    )


@dataclass
class ImageInputs:
    """A micro-batch's images: ``pixel_values`` ``[P, D]`` (patches in row order), ``grid`` ``[n,
    3]``; ``placeholder``: features added as ``0 *`` for the collectives only."""

    pixel_values: torch.Tensor
    grid: torch.Tensor
    placeholder: bool = False


def image_inputs(data: TensorDict, spec: VisionSpec) -> ImageInputs | None:
    """The images of a compact micro-batch flattened in row order (each row gets its copy of its
    entry), or None without any; reads grids and entries on the host."""
    if PIXEL_VALUES_KEY not in data:
        return None
    store, index = image_store(data)
    grid = data[IMAGE_GRID_KEY]
    counts = grid.prod(-1)  # patches per image, 0 for padding
    host = torch.cat([counts, index.unsqueeze(1).to(counts.dtype)], 1).tolist()
    pixels, grids = [], []
    for row, (*row_counts, entry) in enumerate(host):
        patches = sum(row_counts)
        if patches:
            pixels.append(store[entry, :patches])
            grids.append(grid[row, [i for i, c in enumerate(row_counts) if c]])
    if not pixels:
        return None
    return ImageInputs(torch.cat(pixels), torch.cat(grids))


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


def body_hidden(body: nn.Module, images: ImageInputs | None, **inputs: Any) -> torch.Tensor:
    """``last_hidden_state`` of ``body`` with ``images``: their features, computed without the
    text's keyword arguments, go in as ``mm_encoder_outputs``; placeholder images add ``0 *``
    features."""
    if images is None:
        return body(**inputs).last_hidden_state
    features = body.get_image_features(images.pixel_values, images.grid, return_dict=True)
    if images.placeholder:
        hidden = body(**inputs).last_hidden_state
        touch = sum(t.sum() for t in _flat_tensors(dict(features)) if t.is_floating_point())
        return hidden + 0.0 * touch
    return body(**inputs, mm_encoder_outputs={"image": features}).last_hidden_state


def model_positions(
    positions: torch.Tensor, rope: torch.Tensor | None, *, packed: bool
) -> torch.Tensor:
    """The ``position_ids`` a Qwen-VL text model takes from ``positions`` ``[b, L]`` and ``rope``
    ``[b, L, 3]`` (None: text positions on all axes): ``[3, b, L]``, or packed ``[4, 1, N]`` with
    the text positions first (transformers reads sequence boundaries there)."""
    rope3 = positions.unsqueeze(0).expand(3, -1, -1) if rope is None else rope.permute(2, 0, 1)
    return torch.cat([positions.unsqueeze(0), rope3]) if packed else rope3


def prepare_batch(batch: TensorDict, spec: VisionSpec | None) -> TensorDict:
    """The validated batch with its images checked, in the shared store layout, and :data:`ROPE_KEY`
    added (in place on the engine's shallow copy); once per public call.

    Raises:
        ValueError: naming the row and the field: image keys for a text model, image tokens and
            images that do not match, malformed image keys, ``loss_mask`` on an image token or a
            caller's :data:`ROPE_KEY`.
    """
    if ROPE_KEY in batch:
        raise ValueError(
            f"{ROPE_KEY!r} is computed by the engine from input_ids and image_grid_thw; "
            "remove it from the batch"
        )
    present = [key for key in IMAGE_KEYS if key in batch]
    if spec is None:
        if present:
            raise ValueError(f"the batch has {present} but the model has no vision tower")
        return batch
    ids, mask = batch["input_ids"], batch["attention_mask"].to(torch.bool)
    is_image = (ids == spec.image_token_id) & mask
    pair = [key for key in (PIXEL_VALUES_KEY, IMAGE_GRID_KEY) if key in batch]
    if present and len(pair) < 2:
        missing = next(k for k in (PIXEL_VALUES_KEY, IMAGE_GRID_KEY) if k not in batch)
        raise ValueError(f"the batch has {present[0]!r} but no {missing!r}: images need both")
    if not present:
        tokens = is_image.sum(1)
        if bool(tokens.any()):
            row = int(tokens.nonzero()[0, 0])
            raise ValueError(
                f"row {row}: input_ids holds {int(tokens[row])} image token(s) (image_token_id="
                f"{spec.image_token_id}) but the batch has no 'pixel_values' / 'image_grid_thw'"
            )
        return batch
    grid = _check_image_tensors(batch, spec)
    store, index = image_store(batch)
    batch[PIXEL_VALUES_KEY] = UnbatchedTensor(store)  # one copy, whatever the rows' split
    batch[IMAGE_INDEX_KEY] = index
    _check_rows(batch, is_image, grid, spec)
    counts = grid.prod(-1)
    flat_grid = grid[counts > 0]
    # get_rope_index reads the real tokens of each row only: padding placement does not matter.
    rope, _ = spec.body.get_rope_index(
        ids,
        is_image.int(),
        image_grid_thw=flat_grid if len(flat_grid) else None,
        attention_mask=mask.long(),
    )
    batch[ROPE_KEY] = rope.permute(1, 2, 0).contiguous()
    return batch


def _check_image_tensors(batch: TensorDict, spec: VisionSpec) -> torch.Tensor:
    """Dtypes and shapes of the image keys; returns the grid as int64 ``[B, I, 3]``."""
    pixels, grid = batch[PIXEL_VALUES_KEY], batch[IMAGE_GRID_KEY]
    shared = IMAGE_INDEX_KEY in batch
    if not pixels.is_floating_point() or pixels.dim() != 3 or pixels.shape[2] != spec.patch_dim:
        layout = "[G, P, {d}] (the pixel store)" if shared else "[B, P, {d}] (each row's image "
        layout = layout.format(d=spec.patch_dim) + ("" if shared else "patches, zero-padded)")
        raise ValueError(
            f"'pixel_values' must be a float tensor {layout}, got {pixels.dtype} "
            f"{tuple(pixels.shape)}"
        )
    if (
        grid.is_floating_point()
        or grid.dtype == torch.bool
        or grid.dim() != 3
        or grid.shape[2] != 3
    ):
        raise ValueError(
            "'image_grid_thw' must be an integer tensor [B, I, 3] (each row's images' (t, h, w) "
            f"patch grids, all-zero rows padding), got {grid.dtype} {tuple(grid.shape)}"
        )
    rows = batch.batch_size[0]
    if not shared and pixels.shape[0] != rows:
        raise ValueError(
            f"'pixel_values' holds {pixels.shape[0]} entries for {rows} rows: without "
            "'image_index' it is per row [B, P, D]"
        )
    if shared:
        index = batch[IMAGE_INDEX_KEY]
        if index.is_floating_point() or index.dtype == torch.bool or index.shape != (rows,):
            raise ValueError(
                f"'image_index' must be an integer tensor [B] = [{rows}] (each row's entry of "
                f"'pixel_values', -1: none), got {index.dtype} {tuple(index.shape)}"
            )
    return grid.long()


def _check_rows(
    batch: TensorDict, is_image: torch.Tensor, grid: torch.Tensor, spec: VisionSpec
) -> None:
    """Per-row consistency of tokens, grids, entries and patches (host summaries)."""
    counts = grid.prod(-1)  # [B, I] patches per image
    partial = ((grid <= 0).any(-1) & (grid != 0).any(-1)) | (grid < 0).any(-1)
    unmerged = (counts > 0) & ((grid[..., 1:] % spec.merge) != 0).any(-1)
    patches = counts.sum(1)
    starts = is_image.clone()
    starts[:, 1:] &= ~is_image[:, :-1]
    ends = is_image.clone()
    ends[:, :-1] &= ~is_image[:, 1:]
    run_rows = starts.nonzero()[:, 0]
    run_lengths = ends.nonzero()[:, 1] - starts.nonzero()[:, 1] + 1
    real = (counts > 0).nonzero()
    valid = batch["attention_mask"].to(torch.bool)
    store, index = image_store(batch)
    entries = store.shape[0]
    bad_index = (index < -1) | (index >= entries) | ((patches > 0) & (index < 0))
    entry_finite = torch.isfinite(store).all(-1)  # [G, P]: each entry's patches checked once
    pixel_finite = entry_finite[index.clamp(0, max(entries - 1, 0))]  # [B, P]
    within = torch.arange(pixel_finite.shape[1], device=grid.device) < patches.unsqueeze(1)
    bad_pixels = (within & ~pixel_finite).any(1) & ~bad_index
    loss_on_image = None
    if "loss_mask" in batch:
        loss_on_image = (batch["loss_mask"].to(torch.bool) & is_image & valid).nonzero()[:1]
    host = [
        partial.nonzero()[:1].tolist(),
        unmerged.nonzero()[:1].tolist(),
        patches.tolist(),
        is_image.sum(1).tolist(),
        run_rows.tolist(),
        run_lengths.tolist(),
        real[:, 0].tolist(),
        spec.features_per_image(grid[counts > 0]).tolist(),
        bad_pixels.nonzero()[:1].flatten().tolist(),
        [] if loss_on_image is None else loss_on_image.tolist(),
        bad_index.nonzero()[:1].flatten().tolist(),
    ]
    bad_grid, unmerged_at, patches, tokens, run_rows, run_lengths = host[:6]
    image_rows, image_features, bad_pixel_rows, loss_at, bad_entry = host[6:]
    if bad_entry:
        b = bad_entry[0]
        raise ValueError(
            f"row {b}: 'image_index' is {int(index[b])}, but 'pixel_values' holds {entries} "
            "entries (0..G-1; -1 only for a row without images)"
        )
    if bad_grid:
        b, i = bad_grid[0]
        raise ValueError(
            f"row {b}: 'image_grid_thw' image {i} is {grid[b, i].tolist()}: (t, h, w) must all "
            "be > 0, or all 0 for a padding entry"
        )
    if unmerged_at:
        b, i = unmerged_at[0]
        raise ValueError(
            f"row {b}: 'image_grid_thw' image {i} is {grid[b, i].tolist()}: h and w must be "
            f"multiples of the spatial merge size {spec.merge}"
        )
    width = store.shape[1]
    for b, n in enumerate(patches):
        if n > width:
            raise ValueError(
                f"row {b}: 'image_grid_thw' needs {n} patches but 'pixel_values' holds {width} "
                "per entry"
            )
    for b, n_tokens in enumerate(tokens):
        feats = [f for r, f in zip(image_rows, image_features, strict=True) if r == b]
        runs = [n for r, n in zip(run_rows, run_lengths, strict=True) if r == b]
        if n_tokens and not feats:
            raise ValueError(
                f"row {b}: input_ids holds {n_tokens} image token(s) (image_token_id="
                f"{spec.image_token_id}) but the row has no image: its 'pixel_values' / "
                "'image_grid_thw' are missing (all zero)"
            )
        if n_tokens != sum(feats):
            raise ValueError(
                f"row {b}: input_ids holds {n_tokens} image token(s) (image_token_id="
                f"{spec.image_token_id}) but its 'image_grid_thw' gives {sum(feats)} image "
                f"feature(s) ({feats} per image)"
            )
        if runs != feats:
            raise ValueError(
                f"row {b}: the image tokens form runs of {runs} but 'image_grid_thw' gives images "
                f"of {feats} features: one run of placeholder tokens per image, in order, "
                "separated by other tokens (the template's vision start/end tokens)"
            )
    if bad_pixel_rows:
        raise ValueError(f"row {bad_pixel_rows[0]}: 'pixel_values' is not finite on a patch")
    if loss_at:
        raise ValueError(
            f"loss_mask marks an image placeholder token (first at [b, t] = {loss_at[0]}): "
            "image tokens are inputs, never trained on"
        )
