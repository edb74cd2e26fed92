"""Images in a run: the policy's image encoder, the checks at start, the problems' images.

A policy checkpoint with a vision config samples with an
:class:`~microrl.rollout.images.ImageEncoder` of that checkpoint (the one preprocessing
path the trainer shares); a task whose prompts carry images needs such a policy and a sampler
that takes images. Both are checked when the run starts, naming the key, not at the first step
(docs/rollouts.md#images).
"""

from __future__ import annotations

from typing import Any

from microrl.configs.refusals import check_refusals
from microrl.engine.vision import has_vision_config
from microrl.rollout.images import ImageEncoder
from microrl.rollout.samplers.vllm_images import vision_unsupported
from microrl.tasks import Task

__all__ = ["image_encoder_for", "refuse_image_sampling", "task_has_images"]


def task_has_images(task: Task) -> bool:
    """Whether ``task``'s prompts carry images, read from its held-out problems (reading them
    draws nothing from the training stream)."""
    return any(p.images for p in task.eval_problems())


def refuse_image_sampling(cfg: Any) -> None:
    """What cannot sample image prompts yet, refused with a ``ValueError`` naming its key: the
    ``images`` rows of :mod:`microrl.configs.refusals` (the vllm backend where vLLM's Qwen-VL
    code cannot load, a distillation teacher, an agent). ``cfg``: a recipe config."""
    vllm = cfg.rollout.backend == "vllm"  # asking imports vLLM: only when it samples
    check_refusals("images", cfg, facts={"vllm_vision": vision_unsupported() if vllm else None})


def image_encoder_for(cfg: Any, policy_path: str, task: Task) -> ImageEncoder | None:
    """The sampler's image encoder: the policy checkpoint's (``policy_path``, the resolved
    ``model.path``) when it has a vision config, its images bounded by ``task.images.max_pixels``,
    else None; checked against ``task``.

    Raises:
        ValueError: the task's prompts carry images but the policy has no vision config (naming
            ``task.name`` and ``model.path``), the run's sampler cannot take them
            (:func:`refuse_image_sampling`), or ``task.images.max_pixels`` is below one image
            token or the processor's ``min_pixels``.
    """
    vision = has_vision_config(policy_path)
    if task_has_images(task):
        if not vision:
            raise ValueError(
                f"task.name={cfg.task.name} gives prompts with images but model.path="
                f"{cfg.model.path} has no vision config: a vision-language policy (e.g. "
                "Qwen2-VL) reads images, a text model cannot"
            )
        refuse_image_sampling(cfg)
    if not vision:
        return None
    return ImageEncoder.from_pretrained(
        policy_path, max_pixels=cfg.task.images.max_pixels, key="task.images.max_pixels"
    )
