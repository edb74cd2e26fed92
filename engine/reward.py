"""RewardModelEngine: one score per sequence at its last real token; the Bradley-Terry loss.

A sequence-level role (docs/engine.md#sequence-level-roles): the decoder body, then a bias-free
``Linear(H, 1)`` score head applied to the hidden state of each sequence's *last real token*
(the only position that has seen the whole sequence). The batch holds preference pairs:

* ``group`` ``[B]`` int: the pair id; the two rows of a pair share it, so the micro-batch planner
  keeps them in one micro-batch (any padding side, any split, packed or not);
* ``chosen`` ``[B]`` bool (or 0/1 ints): which row of the pair is preferred.

Every group must be exactly one chosen and one rejected row. The loss is the mean over the
mini-batch's pairs of ``-log sigmoid(s_chosen - s_rejected)``; the pair count is the global
denominator (``count_key = "chosen"``: the chosen rows of all micro-batches and data-parallel
ranks, counted before the first micro-batch), so the loss and its gradient do not depend on the
split. ``infer_batch`` returns ``scores`` ``[B]`` in the caller's row order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from microrl.configs.engine import EngineConfig
from microrl.engine.base import Engine
from microrl.engine.models import ValueModel, decoder_body
from microrl.losses.aggregation import LossDenominators
from microrl.losses.metrics import Metric

__all__ = ["RewardModelEngine", "bradley_terry_loss"]


class RewardModelEngine(Engine):
    """Reward model: ``model_output["scores"]`` ``[B]``, trained on chosen/rejected pairs.

    Config: any :class:`~microrl.configs.EngineConfig` (``loss_agg_mode`` and ``seq_len_norm``
    do not apply: the loss is a mean over pairs). ``config.seed`` seeds the score head.
    ``microrl.engine.checkpoint.export.export_merged_model(engine.module, path)`` writes a
    ``*ForSequenceClassification`` model (``num_labels=1``) that transformers loads with the
    trained head; ``export_peft_adapter`` the matching adapter (task type ``SEQ_CLS``);
    ``microrl.engine.checkpoint.reward_model.load_reward_model_checkpoint(dir, base)`` reads a
    ``save_checkpoint`` directory back as that classifier (``task.reward_model``).
    """

    config_class = EngineConfig
    loss_keys = ()
    row_keys = ("group", "chosen")
    count_key = "chosen"  # the denominators count pairs: one chosen row per pair

    def _build_module(self, causal_lm: nn.Module) -> nn.Module:
        hidden_size = causal_lm.get_input_embeddings().embedding_dim
        return ValueModel(
            decoder_body(causal_lm),
            hidden_size,
            seed=self.config.seed,
            bias=False,
            sequence_level=True,
        )

    def _model_forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        targets,
        *,
        training,
        last_index,
        temperature=None,
        **model_kwargs,
    ):
        scores = self.module(
            input_ids, position_ids, attention_mask, last_index=last_index, **model_kwargs
        )
        return {"scores": scores}  # [b]: per row

    def _check_role_batch(self, batch: TensorDict) -> None:
        """Each ``group`` is one pair: two rows, exactly one of them ``chosen`` (one host sync)."""
        if "chosen" not in batch or "group" not in batch:
            return  # inference without pairs: scores only
        chosen = batch["chosen"]
        if chosen.is_floating_point() or chosen.is_complex():
            raise ValueError(f"'chosen' must be a bool (or 0/1 int) tensor [B], got {chosen.dtype}")
        picked = chosen.to(torch.bool)
        group = batch["group"]
        same = group.unsqueeze(0) == group.unsqueeze(1)  # [B, B]
        size = same.sum(dim=1)
        n_chosen = (same & picked.unsqueeze(0)).sum(dim=1)
        flags = [
            (~((chosen == 0) | (chosen == 1)), "'chosen' must hold only 0 and 1"),
            (
                (size != 2) | (n_chosen != 1),
                "each 'group' of a reward-model batch must be one pair: two rows, exactly one "
                "of them chosen",
            ),
        ]
        bad = torch.stack([flag.any() for flag, _ in flags]).tolist()
        for failed, (flag, message) in zip(bad, flags, strict=True):
            if failed:
                row = int(flag.nonzero()[0, 0])
                raise ValueError(
                    f"{message} (first at row {row}: group {int(group[row])}, "
                    f"{int(size[row])} row(s), {int(n_chosen[row])} chosen)"
                )

    def default_loss(
        self, output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """Bradley-Terry over the micro-batch's pairs, a partial mean over the global pair count."""
        return bradley_terry_loss(
            output["scores"], micro_batch["group"], micro_batch["chosen"], denominators
        )


def bradley_terry_loss(
    scores: torch.Tensor,
    group: torch.Tensor,
    chosen: torch.Tensor,
    denominators: LossDenominators,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """``-log sigmoid(s_chosen - s_rejected)`` summed over the pairs present, over the global
    pair count ``denominators.n_seqs`` (times ``grad_scale``): this micro-batch's partial loss.

    Args:
        scores, group, chosen: ``[b]`` per row; a pair is a chosen and a rejected row of one
            group (the planner keeps both in the same micro-batch).
        denominators: from the mini-batch's ``chosen`` rows (``count_key``), so ``n_seqs`` is
            the number of pairs over all micro-batches and ranks.

    Metrics (partial means over the pairs, ``SUM``-reduced): ``bt_loss``, ``accuracy`` (the
    fraction of pairs with ``s_chosen > s_rejected``; ties count as wrong) and ``margin`` (the
    mean ``s_chosen - s_rejected``). No host sync: the pairs are a ``[b, b]`` mask.
    """
    picked = chosen.to(torch.bool)
    pairs = (
        (group.unsqueeze(1) == group.unsqueeze(0)) & picked.unsqueeze(1) & ~picked.unsqueeze(0)
    )  # [i, j]: i is the chosen and j the rejected row of one pair
    margin = scores.unsqueeze(1) - scores.unsqueeze(0)
    zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
    total = torch.where(pairs, -F.logsigmoid(margin), zero).sum()
    n = denominators.n_seqs.to(scores.dtype)
    loss = total / n * denominators.grad_scale
    kept = margin.detach()
    metrics = {
        "bt_loss": Metric((total.detach() / n).float()),
        "accuracy": Metric((torch.where(pairs, (kept > 0).to(kept.dtype), zero).sum() / n).float()),
        "margin": Metric((torch.where(pairs, kept, zero).sum() / n).float()),
    }
    return loss, metrics
