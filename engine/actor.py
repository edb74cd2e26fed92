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
    model: a linear lm head, with a bias, logit scaling and final-logit soft-capping when the model
    has them (Phi, Cohere, Granite, Gemma 2/3: :func:`~microrl.engine.models.logit_transform`), and
    nothing else the probe of :func:`~microrl.engine.models.fused_head_blocker` detects; otherwise, or with
    ``config.use_fused_kernel=False``, through the model's own forward and an fp32 log-softmax.
    :attr:`uses_fused_kernel` tells which, and the choice is logged.

    Entropy is computed by :meth:`infer_batch` and by training passes whose loss uses it
    (``policy_loss.entropy_coef > 0``) or that ask for it (``config.compute_entropy=True``: a
    custom ``loss_fn`` then reads ``output["entropy"]``, with its gradient); otherwise a training
    pass does not compute it, and its output has no ``entropy`` key.

    Temperature: ``config.temperature``, unless the batch carries ``temperature``: ``[B]`` per
    row, or ``[B, T]`` token-aligned (``temperature[b, t]`` is the one token ``t`` was sampled at).

    Rollout/trainer mismatch: whenever the batch carries ``rollout_logprobs``, every pass with a
    loss reports the ``mismatch/*`` metrics (docs/losses.md#rollouttrainer-mismatch) comparing
    them with ``old_logprobs`` (the trainer's log-probs at the sampling weights), or, for a
    custom ``loss_fn`` on a batch without ``old_logprobs`` and with ``policy_loss.bypass_mode``
    (where ``rollout_logprobs`` are the old log-probs), with the current ``logprobs``. The
    default loss also applies the corrections configured in ``config.policy_loss``.

    Fused loss path (``config.fuse_loss``, docs/engine.md): a training pass of the built-in loss
    (``loss_fn=None``) or of :meth:`sft_loss` on the fused head runs the loss inside the head,
    per group of whole sequences, with :func:`microrl.kernels.fused_linear_loss`, which forms
    the head's gradients in forward; custom losses take the kernel + loss path. Loss, metrics
    and gradients are the same to fp32 rounding. :meth:`fuses_loss` tells which path a loss takes.

    Truncated responses (``config.mask_truncated``, DAPO): the ``loss_mask`` of the rows the
    batch's per-row ``truncated`` key marks (responses cut at ``max_new_tokens``) is zeroed where
    the batch enters the engine, before the mini-batch's global denominators are counted, so
    every loss (built-in or custom, fused or not) sees only the kept tokens and the
    normalisation counts only them, exact under any split
    (docs/losses.md#truncated-responses-mask_truncated). A training pass on a batch without
    ``truncated`` is a ``ValueError`` naming ``actor.mask_truncated``.
    """

    config: ActorConfig
    config_class = ActorConfig
    loss_keys = ("loss_mask", "old_logprobs", "advantages")

    def __init__(
        self, model: nn.Module | str | os.PathLike, config: ActorConfig, *, frozen: bool = False
    ) -> None:
        if isinstance(config, ActorConfig) and config.policy_loss.kl_coef > 0:
            self.loss_keys = (*type(self).loss_keys, "ref_logprobs")
        if isinstance(config, ActorConfig) and config.policy_loss.corrects_mismatch:
            self.loss_keys = (*self.loss_keys, "rollout_logprobs")
        if isinstance(config, ActorConfig) and config.policy_loss.bypass_mode:
            # The sampler's log-probs are the ratio's anchor: no old_logprobs needed.
            self.loss_keys = (
                *(key for key in self.loss_keys if key != "old_logprobs"),
                "rollout_logprobs",
            )
        super().__init__(model, config, frozen=frozen)

    def fuses_loss(self, loss_fn: LossFn | None, *, training: bool = True) -> bool:
        """Whether a pass with ``loss_fn`` (None: the configured loss) takes the fused loss path:
        a training pass, ``config.fuse_loss``, the fused head, and the built-in policy loss or
        :meth:`sft_loss` (not overridden by a subclass): losses that are sums over sequences of
        functions of their log-probs and entropy, which the fused path evaluates per group of
        whole sequences. Anything else takes the kernel + loss path."""
        if not (training and self.config.fuse_loss and self.uses_fused_kernel):
            return False
        if loss_fn is None:
            return type(self).default_loss is ActorEngine.default_loss
        builtin = (ActorEngine.default_loss, ActorEngine.sft_loss)
        return getattr(loss_fn, "__self__", None) is self and (
            getattr(loss_fn, "__func__", None) in builtin
        )

    def _checked(self, batch, loss_fn, forward_only, *, role_checks):
        """The validated batch (:meth:`Engine._checked`), with ``config.mask_truncated`` also
        the ``loss_mask`` of its ``truncated`` rows zeroed: the one place every pass goes
        through before the denominators are counted (:meth:`forward_backward_batch`,
        :meth:`train_batch`, :meth:`forward_step` on a plain batch)."""
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
        logprobs, *extra = self.module(
            input_ids,
            position_ids,
            attention_mask,
            targets,
            temperature=self.config.temperature if temperature is None else temperature,
            with_entropy=with_entropy,
            **model_kwargs,
        )
        entropy = extra[0]
        out = {"logprobs": logprobs}
        if entropy is not None:
            out["entropy"] = entropy
        if group_loss is not None:  # the micro-batch's loss, from the head (with its graph)
            out[FUSED_LOSS_KEY] = extra[1]
        return out

    def default_loss(
        self, output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """``policy_loss`` per ``config.policy_loss`` (surrogate + KL + entropy bonus).

        ``ref_logprobs`` (and ``rollout_logprobs``) are used whenever the batch carries them (the
        ``kl`` metric is then reported even with ``kl_coef = 0``). With
        ``policy_loss.bypass_mode`` the ``rollout_logprobs`` are the old log-probs (a batch's
        ``old_logprobs`` are then not read).
        """
        keys = micro_batch.keys()
        bypass = self.config.policy_loss.bypass_mode
        return policy_loss(
            output["logprobs"],
            None if bypass else micro_batch["old_logprobs"],
            micro_batch["advantages"],
            micro_batch["loss_mask"],
            denominators,
            self.config.policy_loss,
            self.config.loss_agg_mode,
            ref_logprobs=micro_batch["ref_logprobs"] if "ref_logprobs" in keys else None,
            entropy=output.get("entropy", None),
            rollout_logprobs=micro_batch["rollout_logprobs"]
            if "rollout_logprobs" in keys
            else None,
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
        """Negative log-likelihood of the ``loss_mask`` tokens: pass as ``loss_fn`` for SFT.

        Needs only ``input_ids``, ``attention_mask`` and ``loss_mask`` in the batch, e.g.
        ``engine.forward_backward_batch(batch, loss_fn=engine.sft_loss)``; for a full SFT step use
        :meth:`train_batch` with ``loss_fn=engine.sft_loss``.
        """
        return sft_loss(
            output["logprobs"],
            micro_batch["loss_mask"],
            denominators,
            self.config.loss_agg_mode,
            validate=False,
        )


def mask_truncated_rows(batch: TensorDict, *, required: bool = True) -> TensorDict:
    """``batch`` (validated, the engine's own shallow copy) with its ``loss_mask`` entry replaced
    by one that is 0 on the rows its ``truncated`` ``[B]`` key marks (a new tensor: the caller's
    mask is left alone); no host sync.

    ``required``: a batch without ``truncated`` is a ``ValueError`` naming
    ``actor.mask_truncated`` (a training pass); otherwise it is returned unchanged (a
    forward-only pass needs only ``input_ids``).
    """
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
