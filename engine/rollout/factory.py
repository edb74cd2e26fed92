"""Pick a rollout backend by name (``rollout.backend`` in the recipes' configs)."""

from __future__ import annotations

from microrl.configs.rollout import ROLLOUT_BACKENDS, VLLMConfig
from microrl.engine.rollout.base import RolloutBackend
from microrl.engine.rollout.hf import HFRollout
from microrl.engine.rollout.images import ImageEncoder

__all__ = ["make_rollout_backend"]


def make_rollout_backend(
    backend: str,
    engine,
    tokenizer,
    *,
    vllm: VLLMConfig | None = None,
    sync_check_tol: float | None = None,
    image_encoder: ImageEncoder | None = None,
) -> RolloutBackend:
    """The ``backend`` (``"hf"`` or ``"vllm"``) sampling from ``engine``'s policy.

    ``vllm`` configures the ``vllm`` backend (defaults when omitted); the ``hf`` backend needs
    nothing; ``sync_check_tol`` bounds the check of each ``vllm`` sync (None: by the engine's
    precision). A ``vllm`` backend without vLLM installed raises ``ImportError`` with the command
    that installs it. ``image_encoder``: a vision-language policy's, for the ``hf`` backend
    (the ``vllm`` backend takes no image prompts yet; the recipes refuse them at start).
    """
    if backend == "hf":
        return HFRollout(engine, tokenizer, image_encoder=image_encoder)
    if backend == "vllm":
        from microrl.engine.rollout.vllm import VLLMRollout

        return VLLMRollout(engine, tokenizer, vllm or VLLMConfig(), sync_check_tol=sync_check_tol)
    raise ValueError(
        f"rollout.backend must be one of {', '.join(ROLLOUT_BACKENDS)}, got {backend!r}"
    )
