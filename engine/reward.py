"""RewardModelEngine: one score per sequence at its last real token; the Bradley-Terry loss.

A sequence-level role (docs/engine.md#sequence-level-roles): a bias-free ``Linear(H, 1)`` score
head on each sequence's *last real token* (the only position that has seen the whole sequence).
The batch holds preference pairs: ``group`` ``[B]`` int (the pair id) and ``chosen`` ``[B]`` bool
(or 0/1); the batch contract and loss: docs/engine.md#actor-and-critic.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from microrl.configs.engine import EngineConfig
from microrl.engine import setup
from microrl.engine.base import Engine
from microrl.engine.models import ValueModel, decoder_body
from microrl.losses.aggregation import LossDenominators
from microrl.losses.metrics import Metric

__all__ = ["RewardModelEngine", "bradley_terry_loss", "classifier_head"]

_CLASSIFIER = "ForSequenceClassification"  # transformers' sequence classifiers' class names


class RewardModelEngine(Engine):
    """Reward model: ``model_output["scores"]`` ``[B]``, trained on chosen/rejected pairs.

    ``model``: a causal LM (a fresh score head, seeded by ``config.seed``), a transformers
    ``*ForSequenceClassification`` with one label (its own score head), as objects or
    checkpoints; or, with ``base`` (the base model it was trained from), a directory this
    engine's ``save_checkpoint`` wrote. ``frozen``: scoring only (what ``task.reward_model``
    uses). Config: any :class:`~microrl.configs.EngineConfig` (``loss_agg_mode`` and
    ``seq_len_norm`` do not apply). Exports: docs/engine.md#exports-of-critics-and-reward-models.
    """

    config_class = EngineConfig
    loss_keys = ()
    row_keys = ("group", "chosen")
    count_key = "chosen"  # the denominators count pairs: one chosen row per pair

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        config: EngineConfig,
        *,
        frozen: bool = False,
        base: str | os.PathLike | nn.Module | None = None,
    ) -> None:
        self._base = base
        super().__init__(model, config, frozen=frozen)

    def _load_model(self, model: nn.Module | str | os.PathLike, dtype: torch.dtype) -> nn.Module:
        """A causal LM, a ``*ForSequenceClassification`` (its ``config.architectures`` say so), or,
        given ``base``, a ``save_checkpoint`` directory read back as the classifier it trained."""
        from microrl.engine.checkpoint import reward_model as engine_rm

        if not isinstance(model, (str, os.PathLike)):
            return setup.load_causal_lm(model, dtype)
        if self._base is not None:
            return engine_rm.load_reward_model_checkpoint(model, self._base, dtype=dtype)
        from transformers import AutoConfig, AutoModelForSequenceClassification

        architectures = AutoConfig.from_pretrained(model).architectures or []
        if any(name.endswith(_CLASSIFIER) for name in architectures):
            return AutoModelForSequenceClassification.from_pretrained(model, dtype=dtype)
        return setup.load_causal_lm(model, dtype)

    def _build_module(self, causal_lm: nn.Module) -> nn.Module:
        hidden_size = causal_lm.get_input_embeddings().embedding_dim
        module = ValueModel(
            decoder_body(causal_lm),
            hidden_size,
            seed=self.config.seed,
            bias=False,
            sequence_level=True,
        )
        head = classifier_head(causal_lm)
        if head is not None:  # a trained classifier scores with its own head, in fp32
            with torch.no_grad():
                module.value_head.weight.copy_(head.weight)
        return module

    def _model_forward(self, *inputs, last_index, **kwargs):  # declared: the engine passes it
        return {"scores": self._module_forward(*inputs, last_index=last_index, **kwargs)}  # [b]

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


def classifier_head(model: nn.Module) -> nn.Linear | None:
    """The score head of a transformers ``*ForSequenceClassification`` (``model.score``), or None
    for another model (a causal LM: the engine initialises a fresh head).

    Raises:
        ValueError: a classifier with more than one label, or a head with a bias.
    """
    if not type(model).__name__.endswith(_CLASSIFIER):
        return None
    head = getattr(model, "score", None)
    labels = getattr(model.config, "num_labels", None)
    if labels != 1 or not isinstance(head, nn.Linear) or head.out_features != 1:
        raise ValueError(f"{type(model).__name__} has {labels} labels; a scalar reward model has 1")
    if head.bias is not None:
        raise ValueError(
            f"{type(model).__name__}'s score head has a bias; a reward model's is bias-free"
        )
    return head


def bradley_terry_loss(
    scores: torch.Tensor,
    group: torch.Tensor,
    chosen: torch.Tensor,
    denominators: LossDenominators,
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """``-log sigmoid(s_chosen - s_rejected)`` summed over the pairs present, over the global
    pair count ``denominators.n_seqs`` (times ``grad_scale``): this micro-batch's partial loss.

    ``scores``, ``group``, ``chosen``: ``[b]`` per row. Metrics (partial means over pairs,
    ``SUM``): ``bt_loss``, ``accuracy`` (ties count as wrong) and ``margin``. No host sync.
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
