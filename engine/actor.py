"""ActorEngine: the policy. Per-token log-probs (and entropy) of the taken tokens; the policy loss."""

from __future__ import annotations

import logging
import os

import torch
from tensordict import TensorDict
from torch import nn

from microrl.configs.engine import ActorConfig
from microrl.engine.base import Engine, LossFn
from microrl.engine.group_loss import GroupLoss
from microrl.engine.models import PolicyModel, fused_head_blocker
from microrl.engine.outputs import FUSED_LOSS_KEY
from microrl.losses import MISMATCH_METRICS, mismatch_metrics, policy_loss, sft_loss
from microrl.losses.aggregation import LossDenominators
from microrl.losses.metrics import Metric

__all__ = ["TRUNCATED_KEY", "ActorEngine", "mask_truncated_rows"]

logger = logging.getLogger(__name__)

#: The per-row ``[B]`` bool key marking responses cut at ``max_new_tokens`` (no ``<eos>``), set
#: by :func:`microrl.rollout.layout.build_rollout` (docs/batch.md).
TRUNCATED_KEY = "truncated"


class ActorEngine(Engine):
    """The policy engine: ``model_output`` holds ``logprobs`` (and ``entropy``) ``[B, T]``.

    The head runs through :func:`microrl.kernels.fused_linear_logprob` when that is exact for the
    model (:func:`~microrl.engine.models.fused_head_blocker` probes it), else through the
    model's own forward and an fp32 log-softmax; :attr:`uses_fused_kernel` tells which
    (docs/engine.md#head-paths). Entropy and temperature (``[B]`` per row or ``[B, T]``
    token-aligned): docs/engine.md#actor-and-critic. With ``rollout_logprobs`` in the batch every
    pass with a loss reports the ``mismatch/*`` metrics (docs/losses.md#rollouttrainer-mismatch).
    ``config.fuse_loss``: the built-in loss and :meth:`sft_loss` run inside the fused head
    (:meth:`fuses_loss`; docs/engine.md#the-fused-loss-path). ``config.mask_truncated`` zeroes the
    ``loss_mask`` of ``truncated`` rows before the denominators are counted
    (docs/losses.md#truncated-responses-mask_truncated).
    """

    config: ActorConfig
    config_class = ActorConfig
    loss_keys = ("loss_mask", "old_logprobs", "advantages")

    def __init__(
        self, model: nn.Module | str | os.PathLike, config: ActorConfig, *, frozen: bool = False
    ) -> None:
        if isinstance(config, ActorConfig):  # the keys the configured policy loss reads
            loss, keys = config.policy_loss, type(self).loss_keys
            keys = (*keys, "ref_logprobs") if loss.kl_coef > 0 else keys
            keys = (*keys, "rollout_logprobs") if loss.corrects_mismatch else keys
            if loss.bypass_mode:  # the sampler's log-probs anchor the ratio: no old_logprobs
                keys = (*(key for key in keys if key != "old_logprobs"), "rollout_logprobs")
            self.loss_keys = keys
        super().__init__(model, config, frozen=frozen)

    def fuses_loss(self, loss_fn: LossFn | None, *, training: bool = True) -> bool:
        """Whether a pass with ``loss_fn`` (None: the configured loss) takes the fused loss path:
        a training pass, ``config.fuse_loss``, the fused head, and the built-in policy loss or
        :meth:`sft_loss` not overridden (sums over sequences, evaluable per group of them)."""
        if not (training and self.config.fuse_loss and self.uses_fused_kernel):
            return False
        if loss_fn is None:
            return type(self).default_loss is ActorEngine.default_loss
        builtin = (ActorEngine.default_loss, ActorEngine.sft_loss)
        return getattr(loss_fn, "__self__", None) is self and (
            getattr(loss_fn, "__func__", None) in builtin
        )

    def _checked(self, batch, loss_fn, forward_only, *, role_checks):
        """The validated batch, with ``config.mask_truncated`` the ``loss_mask`` of its
        ``truncated`` rows zeroed: every pass goes through here before the denominators count."""
        batch = super()._checked(batch, loss_fn, forward_only, role_checks=role_checks)
        if self.config.mask_truncated:
            batch = mask_truncated_rows(batch, required=not forward_only)
        return batch

    def _build_module(self, causal_lm: nn.Module) -> nn.Module:
        blocker = self._from_rank0(lambda: fused_head_blocker(causal_lm))
        fused = self.config.use_fused_kernel and blocker is None
        if blocker is not None:
            logger.warning("lm head is not plain (%s): the model's own head, eager path", blocker)
        elif fused:
            logger.info("actor head: fused lm-head log-prob kernel")
        else:
            logger.info("actor head: eager fp32 head (use_fused_kernel=False)")
        # Targets come from input_ids that check_batch validated against the vocabulary.
        return PolicyModel(
            causal_lm,
            fused=fused,
            plain_head=blocker is None,
            chunk_size=self.config.kernel_chunk_size,
            trusted_targets=True,
        )

    def _model_forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        targets,
        *,
        training,
        temperature=None,
        group_loss: GroupLoss | None = None,
        **model_kwargs,
    ):
        with_entropy = (
            not training or self.config.compute_entropy or self.config.policy_loss.entropy_coef > 0
        )
        if group_loss is not None:  # the loss runs inside the head (fused loss path)
            model_kwargs = {
                **model_kwargs,
                "loss_fn": group_loss,
                "loss_segments": group_loss.segments,
            }
        logprobs, entropy, *loss = self.module(
            input_ids,
            position_ids,
            attention_mask,
            targets,
            temperature=self.config.temperature if temperature is None else temperature,
            with_entropy=with_entropy,
            **model_kwargs,
        )
        out = {"logprobs": logprobs}
        if entropy is not None:
            out["entropy"] = entropy
        if group_loss is not None:  # the micro-batch's loss, from the head (with its graph)
            out[FUSED_LOSS_KEY] = loss[0]
        return out

    def default_loss(
        self, output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """``policy_loss`` per ``config.policy_loss`` (surrogate + KL + entropy bonus).

        ``ref_logprobs`` and ``rollout_logprobs`` are used whenever the batch carries them; with
        ``policy_loss.bypass_mode`` the ``rollout_logprobs`` are the old log-probs."""
        bypass = self.config.policy_loss.bypass_mode
        return policy_loss(
            output["logprobs"],
            None if bypass else micro_batch["old_logprobs"],
            micro_batch["advantages"],
            micro_batch["loss_mask"],
            denominators,
            self.config.policy_loss,
            self.config.loss_agg_mode,
            ref_logprobs=micro_batch.get("ref_logprobs", None),
            entropy=output.get("entropy", None),
            rollout_logprobs=micro_batch.get("rollout_logprobs", None),
            validate=False,  # the engine checked the batch once at its boundary
        )

    def _role_metrics(self, output, micro_batch, denominators, metrics):
        """The ``mismatch/*`` metrics, for every loss that did not report them itself (the
        default loss does), whenever the micro-batch carries ``rollout_logprobs``."""
        keys = micro_batch.keys()
        if "rollout_logprobs" not in keys or any(name in metrics for name in MISMATCH_METRICS):
            return {}
        rollout = micro_batch["rollout_logprobs"]
        train = micro_batch["old_logprobs"] if "old_logprobs" in keys else output["logprobs"]
        return mismatch_metrics(
            train.detach().to(rollout.dtype),
            rollout,
            micro_batch["loss_mask"],
            denominators,
            validate=False,  # check_batch validated both keys on the loss tokens
        )

    def sft_loss(
        self, output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """Negative log-likelihood of the ``loss_mask`` tokens: pass as ``loss_fn`` for SFT, e.g.
        ``engine.train_batch(batch, loss_fn=engine.sft_loss)`` (needs only ``input_ids``,
        ``attention_mask`` and ``loss_mask``)."""
        return sft_loss(
            output["logprobs"],
            micro_batch["loss_mask"],
            denominators,
            self.config.loss_agg_mode,
            validate=False,
        )


def mask_truncated_rows(batch: TensorDict, *, required: bool = True) -> TensorDict:
    """``batch`` (validated, the engine's own shallow copy) with a new ``loss_mask``, 0 on the
    rows its ``truncated`` ``[B]`` key marks; no host sync. Without ``truncated``: a
    ``ValueError`` naming ``actor.mask_truncated`` if ``required`` (training), else unchanged."""
    if TRUNCATED_KEY not in batch:
        if not required:
            return batch
        raise ValueError(
            f"actor.mask_truncated is on, but the batch has no {TRUNCATED_KEY!r} key: a per-row "
            "bool tensor [B], True for a response cut at max_new_tokens (build_rollout sets "
            "it); add it, or set actor.mask_truncated=false to train on such responses"
        )
    flags = batch[TRUNCATED_KEY]
    rows = batch.batch_size[0]
    if tuple(flags.shape) != (rows,) or flags.is_floating_point() or flags.is_complex():
        raise ValueError(
            f"{TRUNCATED_KEY!r} must be a bool (or 0/1 integer) tensor [B] = ({rows},) for "
            f"actor.mask_truncated, got {flags.dtype} {tuple(flags.shape)}"
        )
    if "loss_mask" in batch:
        mask = batch["loss_mask"]
        zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
        batch["loss_mask"] = torch.where(flags.to(torch.bool)[:, None], zero, mask)
    return batch
