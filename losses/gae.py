"""Generalised advantage estimation (Schulman et al. 2016) on the token grid."""

from __future__ import annotations

import torch

from ._checks import check_reward_inputs

__all__ = ["gae_advantages"]


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns, ``[B, T]`` each.

    Over the loss tokens ``t_1 < t_2 < ... < t_n`` of a row (positions outside the mask are
    *skipped*, not terminal: tool outputs inside a multi-turn response pass the next value and
    the running advantage through unchanged)::

        delta_k = r[t_k] + gamma * V[t_{k+1}] - V[t_k]        (V[t_{n+1}] = 0: the episode ends)
        A[t_k]  = delta_k + gamma * lam * A[t_{k+1}]
        R[t_k]  = A[t_k] + V[t_k]

    Rewards and values at masked positions are ignored (removed with ``torch.where``, so NaN there
    is harmless); advantages and returns there are 0. Computed in float64, returned in the dtype
    of ``values``.

    Args:
        rewards: ``[B, T]`` token-level rewards (see :func:`scores_to_token_rewards`).
        values: ``[B, T]`` critic values ``V(s_t)`` at each token.
        response_mask: ``[B, T]`` the tokens the policy produced (the loss mask).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1] (1: Monte-Carlo returns minus V; 0: one-step TD).
    """
    tensors, fractions = {"rewards": rewards, "values": values}, {"gamma": gamma, "lam": lam}
    mask = check_reward_inputs(response_mask, tensors, fractions)
    r = torch.where(mask, rewards.double(), 0.0)
    v = torch.where(mask, values.double(), 0.0)
    batch = mask.shape[0]
    next_value = torch.zeros(batch, dtype=torch.float64, device=v.device)
    running = torch.zeros_like(next_value)
    advantages = torch.zeros_like(v)
    for t in reversed(_active_columns(mask)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        candidate = delta + gamma * lam * running
        m = mask[:, t]
        running = torch.where(m, candidate, running)
        next_value = torch.where(m, v[:, t], next_value)
        advantages[:, t] = torch.where(m, candidate, 0.0)
    returns = torch.where(mask, advantages + v, 0.0)
    return advantages.to(values.dtype), returns.to(values.dtype)


def _active_columns(mask: torch.Tensor) -> range:
    """Columns from the first to the last one holding a loss token (one host sync): the
    backward recursion need not walk the prompt and padding columns."""
    active = mask.any(dim=0).nonzero()
    if active.numel() == 0:
        return range(0)
    first, last = (int(i) for i in active[[0, -1], 0].tolist())
    return range(first, last + 1)
