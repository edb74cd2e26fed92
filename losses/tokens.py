"""Moving per-sequence quantities onto the token grid ``[B, T]`` of the loss mask."""

from __future__ import annotations

import torch

__all__ = ["broadcast_to_tokens", "scores_to_token_rewards"]


def _check_rows(per_sequence: torch.Tensor, loss_mask: torch.Tensor, name: str) -> torch.Tensor:
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    if per_sequence.shape != loss_mask.shape[:1]:
        raise ValueError(
            f"{name} must be [B] = [{loss_mask.shape[0]}] (one per row of loss_mask), "
            f"got {tuple(per_sequence.shape)}"
        )
    if per_sequence.device != loss_mask.device:
        raise ValueError(f"{name} is on {per_sequence.device} but loss_mask on {loss_mask.device}")
    return loss_mask.to(torch.bool)


def broadcast_to_tokens(per_sequence: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Spread a per-sequence value ``[B]`` (e.g. a GRPO advantage) onto the loss tokens ``[B, T]``.

    Every loss token of row ``b`` gets ``per_sequence[b]``; masked positions get exactly 0.
    Integer/bool inputs become float32; floating inputs keep their dtype.
    """
    mask = _check_rows(per_sequence, loss_mask, "per_sequence")
    if not per_sequence.is_floating_point():
        per_sequence = per_sequence.float()
    zero = torch.zeros((), dtype=per_sequence.dtype, device=per_sequence.device)
    return torch.where(mask, per_sequence[:, None], zero)


def scores_to_token_rewards(
    scores: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Token-level rewards ``[B, T]`` for GAE / REINFORCE++: the score on the last loss token.

    ``rewards[b, t] = scores[b] * [t is the last loss token of b] - kl_coef * kl[b, t]`` on loss
    tokens, 0 elsewhere (the per-token KL-in-reward shaping of PPO-RLHF, Ouyang et al. 2022).
    A row without loss tokens gets no reward.

    Args:
        scores: ``[B]`` outcome reward per sequence.
        loss_mask: ``[B, T]`` response tokens.
        kl: optional ``[B, T]`` per-token KL estimate (e.g. :func:`kl_penalty`, detached here).
        kl_coef: weight of the KL shaping (>= 0).
    """
    mask = _check_rows(scores, loss_mask, "scores")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    steps = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, steps, -1).amax(dim=1, keepdim=True)  # -1: no loss token
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    rewards = torch.where(steps[None, :] == last, scores.to(dtype)[:, None], zero)
    if kl is not None:
        if kl.shape != mask.shape:
            raise ValueError(
                f"kl must have the shape of loss_mask {tuple(mask.shape)}, got {tuple(kl.shape)}"
            )
        rewards = rewards - kl_coef * torch.where(mask, kl.detach().to(dtype), zero)
    elif kl_coef > 0:
        raise ValueError("kl is required when kl_coef > 0")
    return rewards
