"""Group-relative advantages: GRPO (with and without std scaling = Dr.GRPO) and RLOO.

Each prompt is sampled several times; the rows of one prompt form a *group*, given by a per-row
integer ``group_ids`` (any values: 0..G-1, prompt hashes, ...). Statistics are computed in float64.

Two guarantees users rely on:

* A group whose scores are all equal (a zero-variance group: all correct or all wrong) gets
  advantage **exactly 0**, decided on the float64 spread ``max - min == 0``. Normalising float32
  residue instead would turn 0.35-vs-0.35 into advantages of thousands.
* A singleton group has no baseline: its advantage is 0, and it is counted
  (``GroupAdvantageInfo.num_singleton_groups``), since it usually means the batch was split badly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_finite_vectors

__all__ = [
    "GROUP_STD_EPS",
    "GroupAdvantageInfo",
    "GroupStats",
    "check_whole_groups",
    "group_stats",
    "grpo_advantages",
    "rloo_advantages",
]

# Floor of the group std in GRPO's scaling. Only groups with a non-zero spread are divided at all
# (zero-spread groups are exactly 0), so the floor only bounds the scale of a group whose scores
# differ by less than ~1e-6, e.g. float32 noise in a learned reward: at most ~1 per unit spread.
GROUP_STD_EPS = 1e-6


@dataclass(frozen=True)
class GroupStats:
    """Per-row statistics of each row's group (all ``[B]``, float64 / int64 / bool)."""

    index: torch.Tensor  # int64 in [0, G): contiguous group number of the row
    size: torch.Tensor  # int64: rows in the row's group
    mean: torch.Tensor  # float64: group mean score
    std: torch.Tensor  # float64: unbiased group std (0 for a singleton)
    zero_spread: torch.Tensor  # bool: all scores of the group are equal (singletons included)
    num_groups: int


@dataclass(frozen=True)
class GroupAdvantageInfo:
    """What a group estimator saw: counts for logging and the rows worth training on.

    ``informative`` is ``[B]`` bool: the row's group has at least two members and a non-zero
    spread, i.e. its advantage carries signal. Apply :meth:`keep_index` to every per-row tensor
    (or to the batch ``TensorDict``) to drop the zero-variance and singleton groups while keeping
    all of them aligned, in their original order.
    """

    num_groups: int
    num_singleton_groups: int
    num_zero_variance_groups: int  # groups of >= 2 rows with all scores equal
    informative: torch.Tensor

    def keep_index(self) -> torch.Tensor:
        """``[K]`` int64 row indices of the informative rows, ascending (``batch[idx]``)."""
        return self.informative.nonzero().squeeze(1)

    def metrics(self) -> dict[str, float]:
        """Counts for logging (Python floats, one host sync): groups, singletons, zero-variance
        groups and the fraction of rows that carry signal."""
        rows = max(int(self.informative.numel()), 1)
        return {
            "groups/num": float(self.num_groups),
            "groups/singleton": float(self.num_singleton_groups),
            "groups/zero_variance": float(self.num_zero_variance_groups),
            "groups/informative_row_frac": float(self.informative.sum()) / rows,
        }


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Group mean, unbiased std and spread of ``scores [B]`` grouped by ``group_ids [B]``."""
    _check(scores, group_ids)
    s = scores.detach().double()
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=torch.float64, device=s.device).index_add_(0, index, s)
    mean = sums / counts
    centered = s - mean[index]
    squares = torch.zeros_like(sums).index_add_(0, index, centered.square())
    std = (squares / (counts - 1).clamp_min(1)).sqrt()
    high = torch.full_like(sums, -torch.inf).scatter_reduce_(0, index, s, "amax")
    low = torch.full_like(sums, torch.inf).scatter_reduce_(0, index, s, "amin")
    return GroupStats(
        index=index,
        size=counts[index],
        mean=mean[index],
        std=std[index],
        zero_spread=(high == low)[index],
        num_groups=num_groups,
    )


def _info(stats: GroupStats) -> GroupAdvantageInfo:
    singleton_rows = stats.size == 1
    zero_rows = stats.zero_spread & ~singleton_rows
    # Each group of size n contributes n rows: count groups as sum over rows of 1/n.
    per_row = 1.0 / stats.size.double()
    counts = torch.stack([(per_row * singleton_rows).sum(), (per_row * zero_rows).sum()])
    singletons, zero_variance = (round(c) for c in counts.tolist())
    return GroupAdvantageInfo(
        num_groups=stats.num_groups,
        num_singleton_groups=singletons,
        num_zero_variance_groups=zero_variance,
        informative=~stats.zero_spread,
    )


@torch.no_grad()
def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = GROUP_STD_EPS,
) -> tuple[torch.Tensor, GroupAdvantageInfo]:
    """GRPO advantages ``(s - mean_g) / max(std_g, eps)`` per row (Shao et al. 2024).

    ``scale_by_std=False`` is Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"):
    ``s - mean_g``, removing the std's bias toward too-easy/too-hard prompts; pair it with
    ``loss_agg_mode='seq-mean-token-sum-norm'`` to also remove the length bias.

    Args:
        scores: ``[B]`` outcome reward per row (float, int or bool).
        group_ids: ``[B]`` integer group of each row.
        scale_by_std: divide by the unbiased group std (floored at ``eps``).
        eps: the std floor (> 0).

    Returns:
        ``(advantages [B], info)``: advantages in the dtype of ``scores`` (float32 for
        int/bool), exactly 0 for zero-variance and singleton groups; spread them onto tokens with
        :func:`broadcast_to_tokens`.
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    stats = group_stats(scores, group_ids)
    centered = scores.detach().double() - stats.mean
    advantages = centered / stats.std.clamp_min(eps) if scale_by_std else centered
    advantages = torch.where(stats.zero_spread, 0.0, advantages)
    return advantages.to(_out_dtype(scores)), _info(stats)


@torch.no_grad()
def rloo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, GroupAdvantageInfo]:
    """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    ``A_i = s_i - mean_{j in g, j != i} s_j = n / (n - 1) * (s_i - mean_g)``: an unbiased
    baseline from the other samples of the prompt. Exactly 0 for zero-variance and singleton
    groups.

    Returns:
        ``(advantages [B], info)`` as :func:`grpo_advantages`.
    """
    stats = group_stats(scores, group_ids)
    n = stats.size.double()
    advantages = (scores.detach().double() - stats.mean) * n / (n - 1).clamp_min(1)
    advantages = torch.where(stats.zero_spread, 0.0, advantages)
    return advantages.to(_out_dtype(scores)), _info(stats)


def check_whole_groups(group_ids: torch.Tensor, group_size: int) -> None:
    """Raise ``ValueError`` unless every group in ``group_ids [B]`` has exactly ``group_size`` rows
    on this rank.

    ``grpo_advantages`` sees only this rank's rows, so its group mean and std are the true ones
    only when no group spans ranks. Sharding prompts over ranks (each rank samples all
    ``group_size`` responses of its prompts) guarantees that; a group split over ranks, or cut
    short, leaves fewer rows here, which this local check (no collective) catches.
    """
    ids, counts = torch.unique(group_ids, return_counts=True)
    bad = (counts != group_size).nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(f"group {ids[i].item()} has {counts[i].item()}" for i in bad[:3])
        raise ValueError(
            "GRPO groups must not span ranks: every group needs all its "
            f"group_size={group_size} rows on one rank, but here {shown} "
            "(shard prompts over ranks, never the rows of a rollout)"
        )


def _out_dtype(scores: torch.Tensor) -> torch.dtype:
    return scores.dtype if scores.is_floating_point() else torch.float32


def _check(scores: torch.Tensor, group_ids: torch.Tensor) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise ValueError(f"scores must be a [B] tensor, got {getattr(scores, 'shape', scores)!r}")
    if not isinstance(group_ids, torch.Tensor) or group_ids.shape != scores.shape:
        raise ValueError(
            f"group_ids must be a [B] tensor like scores {tuple(scores.shape)}, "
            f"got {getattr(group_ids, 'shape', group_ids)!r}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if scores.is_complex():
        raise ValueError(f"scores must be real, got {scores.dtype}")
    if group_ids.device != scores.device:
        raise ValueError(f"group_ids is on {group_ids.device} but scores on {scores.device}")
    if scores.is_floating_point():
        check_finite_vectors({"scores": scores})
