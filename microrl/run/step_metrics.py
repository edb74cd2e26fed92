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

from microrl.engine.vision import IMAGE_GRID_KEY
from microrl.losses import group_stats, mismatch_log_ratio
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
    groups: torch.Tensor | None = None,
) -> dict[str, float]:
    """A step's metrics: the rollout's rates over every data rank and the updates' means.

    ``batch``: the step's ``[B, T]`` rollout batch (``attention_mask``, ``loss_mask``,
    ``truncated [B]``); ``scores [B]``: the task's rewards; ``penalty [B]``: DAPO's overlong
    penalty (reported as ``reward/overlong_penalty`` when ``overlong``); ``old``: the old
    log-prob pass (its ``entropy [B, T]``), None with ``actor.policy_loss.bypass_mode``, when the
    first update's ``mismatch/*`` stand in, since only it ran at the weights that sampled
    (docs/losses.md); ``updates``, ``critic_updates``: the engines' ``train_batch`` metrics, as
    :func:`~microrl.run.tracking.mean_metrics` (the critic's under ``critic/``); ``t0``: the
    step's start (``time.perf_counter()``), for ``step_time`` and ``tokens_per_s``;
    ``groups [B]``: each row's group (its prompt), for ``frac_reward_zero_std``, the fraction of
    every rank's groups whose rewards trained on (``scores + penalty``) are all equal (TRL's
    ``frac_reward_zero_std``: a GRPO group that teaches nothing); None: not reported.

    When the rollout has rows with images (on any rank) and ``old`` is given, the
    ``mismatch/image/*`` metrics are the ``mismatch/*`` ones over those rows' tokens only
    (docs/rollouts.md#images).
    """
    mask = batch["loss_mask"]
    image = _image_mismatch_sums(batch, old, dist_info)
    zero_std = [] if groups is None else _zero_std_groups(scores + penalty, groups)
    sums = dist_info.sum(
        [
            *zero_std,
            *image,
            scores.sum().item(),
            len(scores),
            batch["attention_mask"].sum().item(),
            0.0 if old is None else (old["entropy"] * mask).sum().item(),
            mask.sum().item(),
            penalty.sum().item(),
            batch["truncated"].sum().item(),
        ]
    )
    zero_std, sums = sums[: len(zero_std)], sums[len(zero_std) :]
    image, sums = sums[: len(image)], sums[len(image) :]
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
    if zero_std:  # (equal-reward groups, groups) summed over the ranks
        metrics["frac_reward_zero_std"] = zero_std[0] / max(zero_std[1], 1.0)
    if old is not None:
        metrics["entropy"] = entropy_sum / max(n_response, 1.0)
        metrics.update(_image_mismatch(image))
    else:
        metrics.update({k: v for k, v in updates[0].items() if k.startswith("mismatch/")})
    return metrics


def _zero_std_groups(rewards: torch.Tensor, groups: torch.Tensor) -> list[float]:
    """This rank's ``[groups whose rewards [B] are all equal, groups]`` (an agent episode's
    branches share its reward: counted or not, a group's spread is the same)."""
    stats = group_stats(rewards, groups)
    zero = torch.zeros(stats.num_groups, dtype=torch.bool, device=rewards.device)
    zero.scatter_(0, stats.index, stats.zero_spread)  # the same value for every row of a group
    return [float(zero.sum().item()), float(stats.num_groups)]


def _image_mismatch_sums(batch: TensorDict, old: TensorDict | None, dist_info: Dist) -> list[float]:
    """This rank's sums for ``mismatch/image/*``: the image rows' loss-token count, sums of
    ``|d|``, ``k3`` and ``exp|d|`` (``d`` the trainer's minus the sampler's log-prob, as in
    :func:`~microrl.losses.mismatch_metrics`), then its ``max |d|`` at its rank's slot of a
    ``world_size`` vector (so the sum over ranks carries every rank's max). Zeros without
    image rows: every rank sums the same number of values."""
    maxima = [0.0] * dist_info.world_size
    if old is None or IMAGE_GRID_KEY not in batch or "rollout_logprobs" not in batch:
        return [0.0, 0.0, 0.0, 0.0, *maxima]
    rows = batch[IMAGE_GRID_KEY].prod(-1).sum(-1) > 0
    mask = batch["loss_mask"].bool() & rows[:, None]
    delta = mismatch_log_ratio(old["logprobs"], batch["rollout_logprobs"], mask).double()
    keep = mask.to(delta.dtype)
    n = mask.sum().item()
    if n:
        maxima[dist_info.rank] = delta.abs().max().item()
    k3 = torch.expm1(delta) - delta  # 0 off the mask (delta is 0 there)
    return [
        float(n),
        delta.abs().sum().item(),
        k3.sum().item(),
        (torch.exp(delta.abs()) * keep).sum().item(),
        *maxima,
    ]


def _image_mismatch(sums: Sequence[float]) -> dict[str, float]:
    """``mismatch/image/*`` from :func:`_image_mismatch_sums` summed over ranks (none when no
    rank had an image row)."""
    n, abs_sum, k3_sum, mult_sum, *maxima = sums
    if not n:
        return {}
    return {
        "mismatch/image/abs_diff_mean": abs_sum / n,
        "mismatch/image/abs_diff_max": max(maxima),
        "mismatch/image/kl_k3": k3_sum / n,
        "mismatch/image/mult_prob_error": mult_sum / n,
    }
