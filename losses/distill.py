"""On-policy distillation: the teacher's per-token reverse KL as an advantage (docs/recipes.md#teachers).

The student samples; a teacher scores the sampled tokens. On token ``t`` of a response the
per-token reverse KL estimate ``log pi_student(y_t) - log pi_teacher(y_t)`` is a cost, so its
negative ``r_t = log pi_teacher(y_t) - log pi_student(y_t)`` is a per-token reward (Agarwal et al.
2024 "GKD"; Thinking Machines' "On-Policy Distillation" write-up, 2025). With discount ``gamma = 0``
(the default) it is the advantage itself; with ``gamma > 0`` the advantage is its discounted sum
over the row's later loss tokens (:func:`~microrl.losses.gae_advantages` with zero values and
``lam = 1``).
"""

from __future__ import annotations

import torch

from .gae import gae_advantages

__all__ = ["distillation_advantages"]


@torch.no_grad()
def distillation_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gamma: float = 0.0,
) -> torch.Tensor:
    """The per-token distillation advantages ``[B, T]`` float32, 0 off ``loss_mask``.

    ``A[t_k] = sum_{j >= k} gamma^(j - k) (teacher[t_j] - student[t_j])`` over the row's loss tokens
    ``t_1 < ... < t_n`` (positions off the mask are skipped, not terminal, as in
    :func:`~microrl.losses.gae_advantages`); ``gamma = 0``: ``teacher - student`` per token.
    Computed in float64. Each row depends on its own tokens only, so the result is the same
    under any micro-batch split or data-parallel layout.

    Args:
        teacher_logprobs: ``[B, T]`` the teacher's log-probs of the sampled tokens
            (token-aligned: value ``[b, t]`` is ``log p(input_ids[b, t] | input_ids[b, :t])``).
        student_logprobs: ``[B, T]`` the student's, at the loss temperature.
        loss_mask: ``[B, T]`` the response tokens.
        gamma: discount in [0, 1].
    """
    if not isinstance(gamma, (int, float)) or not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be a float in [0, 1], got {gamma!r}")
    for name, tensor in (
        ("teacher_logprobs", teacher_logprobs),
        ("student_logprobs", student_logprobs),
    ):
        if tensor.shape != loss_mask.shape:
            raise ValueError(
                f"{name} must have loss_mask's shape {tuple(loss_mask.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
    mask = loss_mask.to(torch.bool)
    # NaN or inf off the mask is harmless (removed by torch.where before arithmetic).
    reward = torch.where(mask, teacher_logprobs.double(), 0.0) - torch.where(
        mask, student_logprobs.double(), 0.0
    )
    advantages, _ = gae_advantages(
        reward, torch.zeros_like(reward), mask, gamma=float(gamma), lam=1.0
    )
    return advantages.float()
