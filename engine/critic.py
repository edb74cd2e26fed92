"""CriticEngine: a scalar value per token from a value head on the decoder body; the value loss."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from microrl.configs.engine import CriticConfig
from microrl.engine.base import Engine
from microrl.engine.models import ValueModel, decoder_body
from microrl.losses import value_loss
from microrl.losses.aggregation import LossDenominators
from microrl.losses.metrics import Metric

__all__ = ["CriticEngine"]


class CriticEngine(Engine):
    """The value engine: ``model_output`` holds ``values`` ``[B, T]``.

    Token alignment as for log-probs: ``values[b, t]`` is the value of the state *before* token
    ``t`` (from the hidden state of token ``t - 1``), the baseline of the action
    ``input_ids[b, t]``; 0 where there is no prediction (first real token, padding). A
    ``Linear(H, 1)`` value head (trainable also under LoRA) replaces the lm head.
    """

    config: CriticConfig
    config_class = CriticConfig
    loss_keys = ("loss_mask", "old_values", "returns")

    def _build_module(self, causal_lm: nn.Module) -> nn.Module:
        hidden_size = causal_lm.get_input_embeddings().embedding_dim
        return ValueModel(decoder_body(causal_lm), hidden_size, seed=self.config.seed)

    def _model_forward(self, *inputs, **kwargs):
        return {"values": self._module_forward(*inputs, **kwargs)}

    def default_loss(
        self, output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """Clipped value loss (``config.cliprange_value``) against ``returns``."""
        return value_loss(
            output["values"],
            micro_batch["old_values"],
            micro_batch["returns"],
            micro_batch["loss_mask"],
            denominators,
            self.config.loss_agg_mode,
            cliprange_value=self.config.cliprange_value,
            validate=False,
        )
