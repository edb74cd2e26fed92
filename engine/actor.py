"""ActorEngine: the policy. Per-token log-probs (and entropy) of the taken tokens; the policy loss."""

from __future__ import annotations

import logging
import os

import torch
from tensordict import TensorDict
from torch import nn

from microrl.configs.engine import ActorConfig
from microrl.engine import packing
from microrl.engine.alignment import next_token_targets
from microrl.engine.base import Engine, LossFn
from microrl.engine.heads import PolicyModel, fused_head_blocker
from microrl.engine.outputs import align_outputs, check_loss_result
from microrl.losses import MISMATCH_METRICS, mismatch_metrics, policy_loss, sft_loss
from microrl.losses.aggregation import LossDenominators
from microrl.losses.metrics import Metric, Reduce

__all__ = ["ActorEngine"]

logger = logging.getLogger(__name__)


class ActorEngine(Engine):
    """The policy engine: ``model_output`` holds ``logprobs`` (and ``entropy``) ``[B, T]``.

    The head runs through :func:`microrl.kernels.fused_linear_logprob` when that is exact for the
    model: a linear lm head, with a bias, logit scaling and final-logit soft-capping when the model
    has them (Phi, Cohere, Granite, Gemma 2/3: :func:`~microrl.engine.heads.logit_transform`), and
    nothing else the probe of :func:`~microrl.engine.heads.fused_head_blocker` detects; otherwise, or with
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
    custom ``loss_fn`` on a batch without ``old_logprobs``, with the current ``logprobs``. The
    default loss also applies the corrections configured in ``config.policy_loss``.

    Fused loss path (``config.fuse_loss``, docs/engine.md): a training pass of the built-in loss
    (``loss_fn=None``) or of :meth:`sft_loss` on the fused head runs the loss inside the head,
    per group of whole sequences, with :func:`microrl.kernels.fused_linear_loss`, which forms
    the head's gradients in forward; custom losses take the kernel + loss path. Loss, metrics
    and gradients are the same to fp32 rounding. :meth:`fuses_loss` tells which path a loss takes.
    """

    config: ActorConfig
    config_class = ActorConfig
    loss_keys = ("loss_mask", "old_logprobs", "advantages")
    _fused_job: _FusedLossJob | None = None  # set for the duration of one fused micro-batch

    def __init__(self, model: nn.Module | str | os.PathLike, config: ActorConfig) -> None:
        if isinstance(config, ActorConfig) and config.policy_loss.kl_coef > 0:
            self.loss_keys = (*type(self).loss_keys, "ref_logprobs")
        if isinstance(config, ActorConfig) and config.policy_loss.corrects_mismatch:
            self.loss_keys = (*self.loss_keys, "rollout_logprobs")
        super().__init__(model, config)

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

    def _forward_compact(self, micro, lengths, loss_fn, denominators, *, training):
        # The one place every pass (forward_backward_batch, train_batch, forward_step) calls the
        # loss: a loss that does not report the mismatch metrics gets them here.
        wrapped = _with_mismatch_metrics(loss_fn)
        if loss_fn is None or not self.fuses_loss(loss_fn, training=training):
            return super()._forward_compact(
                micro, lengths, wrapped, denominators, training=training
            )
        # Fused: the head calls the loss per group of whole sequences (_head_forward reads the
        # job); the loop's own loss call is skipped (loss_fn=None) and the job's result returned.
        job = _FusedLossJob(micro, lengths, wrapped, denominators, self.config.pack_sequences)
        self._fused_job = job
        try:
            _, _, output = super()._forward_compact(
                micro, lengths, None, denominators, training=training
            )
        finally:
            self._fused_job = None
        return job.loss, _combine(job.metrics), output

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

    def _head_forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        targets,
        *,
        training,
        temperature=None,
        **model_kwargs,
    ):
        with_entropy = (
            not training or self.config.compute_entropy or self.config.policy_loss.entropy_coef > 0
        )
        job = self._fused_job
        if job is not None:  # the loss runs inside the head (fused loss path)
            model_kwargs = {**model_kwargs, "loss_fn": job, "loss_segments": job.segments}
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
        if job is not None:
            job.loss = extra[1]
        out = {"logprobs": logprobs}
        if entropy is not None:
            out["entropy"] = entropy
        return out

    def default_loss(
        self, output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """``policy_loss`` per ``config.policy_loss`` (surrogate + KL + entropy bonus).

        ``ref_logprobs`` (and ``rollout_logprobs``) are used whenever the batch carries them (the
        ``kl`` metric is then reported even with ``kl_coef = 0``).
        """
        keys = micro_batch.keys()
        return policy_loss(
            output["logprobs"],
            micro_batch["old_logprobs"],
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


def _with_mismatch_metrics(loss_fn: LossFn | None) -> LossFn | None:
    """A custom ``loss_fn`` that also reports the ``mismatch/*`` metrics when the micro-batch
    carries ``rollout_logprobs`` and the loss did not report them itself (the default loss,
    ``policy_loss``, does). ``None`` (the default loss) is returned as is."""
    if loss_fn is None:
        return None

    def loss_with_mismatch(
        output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        loss, metrics = check_loss_result(loss_fn(output, micro_batch, denominators))
        keys = micro_batch.keys()
        if "rollout_logprobs" in keys and not any(name in metrics for name in MISMATCH_METRICS):
            rollout = micro_batch["rollout_logprobs"]
            train = micro_batch["old_logprobs"] if "old_logprobs" in keys else output["logprobs"]
            metrics = {
                **metrics,
                **mismatch_metrics(
                    train.detach().to(rollout.dtype),
                    rollout,
                    micro_batch["loss_mask"],
                    denominators,
                    validate=False,  # check_batch validated both keys on the loss tokens
                ),
            }
        return loss, metrics

    return loss_with_mismatch


class _FusedLossJob:
    """The engine's loss on one row group of the fused loss path.

    Called by :func:`microrl.kernels.fused_linear_loss` with the predicting-position log-probs
    (and entropy) of the flattened head rows ``[start, end)``, which are whole rows of the
    compact micro-batch (``segments``: row boundaries, padded ``[b, L]`` or packed ``[1, N]``).
    It aligns them to tokens exactly as the loop does (:func:`align_outputs`) and calls the loss
    on those rows of the micro-batch with the mini-batch's denominators: every built-in loss is a
    sum over rows, so the group losses add up to the micro-batch's loss, and their metrics
    (``SUM`` partials, ``MIN``/``MAX``) combine to its metrics (:func:`_combine`).
    """

    def __init__(
        self,
        micro: TensorDict,
        lengths: list[int],
        loss_fn: LossFn,
        denominators: LossDenominators,
        packed: bool,
    ) -> None:
        self.micro, self.loss_fn, self.denominators, self.packed = (
            micro,
            loss_fn,
            denominators,
            packed,
        )
        self.valid = micro["attention_mask"]
        _, self.has_next = next_token_targets(micro["input_ids"], self.valid)
        rows, width = self.valid.shape
        bounds = [0]
        for r in range(rows):
            bounds.append(bounds[-1] + (lengths[r] if packed else width))
        self.segments = bounds
        self.row_of = {bound: r for r, bound in enumerate(bounds)}
        self.metrics: list[dict[str, Metric]] = []
        self.loss: torch.Tensor | None = None

    def __call__(
        self, start: int, end: int, logprobs: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None]:
        r0, r1 = self.row_of[start], self.row_of[end]
        valid, has_next = self.valid[r0:r1], self.has_next[r0:r1]
        raw = (
            {"logprobs": logprobs}
            if entropy is None
            else {"logprobs": logprobs, "entropy": entropy}
        )
        if self.packed:
            index = packing.packed_index(valid, end - start)
            shape = (1, end - start)
            unpack = lambda v: packing.unpack(v, index, valid)  # noqa: E731
        else:
            shape, unpack = (r1 - r0, valid.shape[1]), None
        raw = {key: value.view(shape) for key, value in raw.items()}
        aligned = align_outputs(raw, r1 - r0, shape, has_next, unpack, "ActorEngine")
        output = TensorDict(aligned, batch_size=[r1 - r0], device=logprobs.device)
        loss, metrics = check_loss_result(
            self.loss_fn(output, self.micro[r0:r1], self.denominators)
        )
        self.metrics.append(metrics)
        return loss, None


def _combine(per_group: list[dict[str, Metric]]) -> dict[str, Metric]:
    """The metrics of a micro-batch from those of its row groups: ``SUM`` partials add up,
    ``MIN``/``MAX`` take the extreme (on device, no sync)."""
    if len(per_group) == 1:
        return per_group[0]
    names = list(per_group[0])
    out = {}
    for name in names:
        kind = per_group[0][name].reduce
        values = torch.stack([group[name].value.reshape(()) for group in per_group])
        if kind is Reduce.SUM:
            value = values.sum()
        else:
            value = values.min() if kind is Reduce.MIN else values.max()
        out[name] = Metric(value, kind)
    return out
