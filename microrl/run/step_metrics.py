"""The metrics both recipes log for an RL step: one place for the rollout's counts over the ranks.

The counts (rewards, rows, tokens, entropy, response tokens, penalty, truncations) are summed over
the data ranks in one collective, so every rate is that of the whole rollout, the one a single
process would report on the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict

from microrl.run.dist import Dist
from microrl.run.tracking import mean_metrics

__all__ = ["step_metrics"]


def step_metrics(
    batch: TensorDict,
    scores: torch.Tensor,
    penalty: torch.Tensor,
    old: TensorDict | None,
    updates: Sequence[Mapping[str, float]],
    dist_info: Dist,
    t0: float,
    *,
    critic_updates: Sequence[Mapping[str, float]] = (),
    overlong: bool = False,
) -> dict[str, float]:
    """A step's metrics: the rollout's rates over every data rank and the updates' means.

    ``batch``: the step's ``[B, T]`` rollout batch (``attention_mask``, ``loss_mask``,
    ``truncated [B]``); ``scores [B]``: the task's rewards; ``penalty [B]``: DAPO's overlong
    penalty (reported as ``reward/overlong_penalty`` when ``overlong``); ``old``: the old
    log-prob pass (its ``entropy [B, T]``), None with ``actor.policy_loss.bypass_mode``, when the
    first update's ``mismatch/*`` stand in, since only it ran at the weights that sampled
    (docs/losses.md); ``updates``, ``critic_updates``: the engines' ``train_batch`` metrics, as
    :func:`~microrl.run.tracking.mean_metrics` (the critic's under ``critic/``); ``t0``: the
    step's start (``time.perf_counter()``), for ``step_time`` and ``tokens_per_s``.
    """
    mask = batch["loss_mask"]
    sums = dist_info.sum(
        [
            scores.sum().item(),
            len(scores),
            batch["attention_mask"].sum().item(),
            0.0 if old is None else (old["entropy"] * mask).sum().item(),
            mask.sum().item(),
            penalty.sum().item(),
            batch["truncated"].sum().item(),
        ]
    )
    reward_sum, n_rows, n_tokens, entropy_sum, n_response, penalty_sum, n_cut = sums
    step_time = time.perf_counter() - t0
    metrics = {
        "reward": reward_sum / n_rows,
        **mean_metrics(list(updates)),
        **mean_metrics(list(critic_updates), prefix="critic/"),
        "response_tokens": n_response / n_rows,
        "truncated_frac": n_cut / n_rows,  # responses cut at max_new_tokens
        "tokens_per_s": n_tokens / step_time,
        "step_time": step_time,
    }
    if overlong:
        metrics["reward/overlong_penalty"] = penalty_sum / n_rows
    if old is not None:
        metrics["entropy"] = entropy_sum / max(n_response, 1.0)
    else:
        metrics.update({k: v for k, v in updates[0].items() if k.startswith("mismatch/")})
    return metrics
