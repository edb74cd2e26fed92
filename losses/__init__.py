"""microrl.losses: policy/value/KL/entropy/SFT losses, loss aggregation and advantage estimators.

Torch only (no transformers, peft or accelerate). Every loss takes ``[B, T]`` token-aligned
tensors, a loss mask, the mini-batch's global :class:`LossDenominators` and a
``loss_agg_mode``, and returns this micro-batch's *partial* loss plus summable :class:`Metric` s
(docs/batch.md, docs/losses.md): summed over micro-batches and ranks they are exact.

A GRPO step, end to end::

    adv, info = grpo_advantages(scores, group_ids)                 # [B], zero-variance groups -> 0
    batch = batch[info.keep_index()]                               # optional: drop them, aligned
    batch["advantages"] = broadcast_to_tokens(adv[info.keep_index()], batch["loss_mask"])
    denominators = global_denominators(batch["loss_mask"])         # once per mini-batch
    for micro in batch.split(micro_batch_size):                    # the engine's loop
        loss, metrics = policy_loss(logprobs, micro["old_logprobs"], micro["advantages"],
                                    micro["loss_mask"], denominators, config, "token-mean")
        loss.backward()
    log = reduce_metrics(all_micro_batch_metrics)                  # Python floats, exact

PPO: ``scores_to_token_rewards`` -> ``gae_advantages`` (-> ``whiten``) for the actor,
``value_loss`` for the critic. One algorithm per module: surrogates (``ppo``, ``gspo``, ``cispo``,
``reinforce``), ``kl``, ``entropy``, ``value``, ``sft``, ``router`` (MoE routers), mismatch
(``tis``, ``mismatch``), advantages (``gae``; ``group``: GRPO, RLOO, after ``check_whole_groups``
under data parallelism; ``reinforce_pp``, ``whiten``). ``policy`` dispatches by the loss type.
"""

from .aggregation import (
    AggMode,
    LossDenominators,
    aggregate,
    global_denominators,
    masked_partial_mean,
)
from .cispo import cispo_surrogate
from .config import (
    KL_IS_ESTIMATORS,
    KLEstimator,
    PolicyLossConfig,
    PolicyLossType,
    RouterLossConfig,
)
from .distill import distillation_advantages
from .entropy import entropy_bonus
from .gae import gae_advantages
from .group import (
    GROUP_STD_EPS,
    GroupAdvantageInfo,
    GroupStats,
    check_whole_groups,
    group_stats,
    grpo_advantages,
    rloo_advantages,
)
from .gspo import gspo_surrogate
from .kl import K3_MAX, KL_LOG_RATIO_CLAMP, kl_penalty
from .metrics import Metric, Reduce, reduce_metrics
from .mismatch import (
    MISMATCH_METRICS,
    RolloutCorrection,
    mismatch_log_ratio,
    mismatch_metrics,
    rollout_correction,
)
from .policy import POLICY_SURROGATES, Surrogate, policy_loss
from .ppo import ppo_surrogate
from .ratio import (
    LOG_RATIO_CLAMP,
    SurrogateOutput,
    clamped_log_ratio,
    importance_ratio,
    sequence_log_ratio,
)
from .reinforce import reinforce_surrogate
from .reinforce_pp import reinforce_pp_advantages
from .router import RouterDenominators, load_balancing_partial, z_loss_partial
from .sft import sft_loss
from .tokens import broadcast_to_tokens, scores_to_token_rewards
from .value import value_loss
from .whiten import WHITEN_EPS, whiten

__all__ = [
    "GROUP_STD_EPS",
    "K3_MAX",
    "KL_IS_ESTIMATORS",
    "KL_LOG_RATIO_CLAMP",
    "LOG_RATIO_CLAMP",
    "MISMATCH_METRICS",
    "POLICY_SURROGATES",
    "WHITEN_EPS",
    "AggMode",
    "GroupAdvantageInfo",
    "GroupStats",
    "KLEstimator",
    "LossDenominators",
    "Metric",
    "PolicyLossConfig",
    "PolicyLossType",
    "Reduce",
    "RolloutCorrection",
    "RouterDenominators",
    "RouterLossConfig",
    "Surrogate",
    "SurrogateOutput",
    "aggregate",
    "broadcast_to_tokens",
    "check_whole_groups",
    "cispo_surrogate",
    "clamped_log_ratio",
    "distillation_advantages",
    "entropy_bonus",
    "gae_advantages",
    "global_denominators",
    "group_stats",
    "grpo_advantages",
    "gspo_surrogate",
    "importance_ratio",
    "kl_penalty",
    "load_balancing_partial",
    "masked_partial_mean",
    "mismatch_log_ratio",
    "mismatch_metrics",
    "policy_loss",
    "ppo_surrogate",
    "reduce_metrics",
    "reinforce_pp_advantages",
    "reinforce_surrogate",
    "rloo_advantages",
    "rollout_correction",
    "scores_to_token_rewards",
    "sequence_log_ratio",
    "sft_loss",
    "value_loss",
    "whiten",
    "z_loss_partial",
]
