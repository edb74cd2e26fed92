"""REINFORCE++ advantages (Hu et al. 2025, "REINFORCE++: a simple and efficient approach for
aligning large language models"): critic-free, normalised over the whole batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._checks import check_reward_inputs
from .gae import _active_columns
from .group import GroupAdvantageInfo, _info, group_stats
from .whiten import whiten

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["reinforce_pp_advantages"]


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    group_ids: torch.Tensor | None = None,
    whiten_advantages: bool = True,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, GroupAdvantageInfo | None]:
    """REINFORCE++ per-token advantages ``[B, T]``.

    * Without ``group_ids`` (REINFORCE++): the discounted return-to-go over the loss tokens,
      ``G[t_k] = r[t_k] + gamma * G[t_{k+1}]`` (masked positions skipped), then whitened over all
      loss tokens of the batch. Token rewards usually hold the score on the last token minus a
      per-token KL (:func:`scores_to_token_rewards`).
    * With ``group_ids`` (REINFORCE++-baseline): the sequence score ``s_i = sum_t r[i, t]`` minus
      its group mean, on every loss token (exactly 0 for zero-variance and singleton groups), then
      whitened over the batch (which shifts those zeros by the batch mean, as in the paper).
      ``gamma`` must be 1 here: the baseline is per sequence.

    Args:
        token_rewards: ``[B, T]`` token-level rewards.
        response_mask: ``[B, T]`` loss tokens; other positions are ignored and 0 in the result.
        gamma: discount in [0, 1].
        group_ids: optional ``[B]`` integer group per row for the baseline variant.
        whiten_advantages: batch whitening (the paper's global advantage normalisation).
        group: the data-parallel process group: whitening then spans the rows of every rank
            (:func:`whiten`), so the result does not depend on the number of ranks. Groups of
            ``group_ids`` must not span ranks (their baseline is computed locally).

    Returns:
        ``(advantages [B, T], info)``, ``info`` a :class:`GroupAdvantageInfo` with
        ``group_ids``, else ``None``. Advantages have the dtype of ``token_rewards``.
    """
    mask = check_reward_inputs(response_mask, {"token_rewards": token_rewards}, {"gamma": gamma})
    r = torch.where(mask, token_rewards.double(), 0.0)
    info = None
    if group_ids is not None:
        if gamma != 1.0:
            raise ValueError("gamma must be 1.0 with group_ids (the baseline is per sequence)")
        scores = r.sum(dim=1)
        stats = group_stats(scores, group_ids)
        per_row = torch.where(stats.zero_spread, 0.0, scores - stats.mean)
        advantages = torch.where(mask, per_row[:, None], 0.0)
        info = _info(stats)
    else:
        advantages = torch.zeros_like(r)
        running = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
        for t in reversed(_active_columns(mask)):
            running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
            advantages[:, t] = torch.where(mask[:, t], running, 0.0)
    if whiten_advantages:
        advantages = whiten(advantages, mask, group=group)
    return advantages.to(token_rewards.dtype), info
