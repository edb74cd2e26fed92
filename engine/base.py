"""The micro-batched training loop every engine role shares (docs/engine.md).

:meth:`Engine.forward_backward_batch` runs a mini-batch through :meth:`Engine.forward_step` one
micro-batch at a time; :meth:`Engine.train_batch` adds the optimizer step. The hooks a role
overrides: docs/engine.md#writing-a-role; the loop is written once, here.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from microrl.configs.engine import EngineConfig
from microrl.engine import moe, packing, setup, vision
from microrl.engine.alignment import next_token_targets, predicting_temperature
from microrl.engine.group_loss import GroupLoss
from microrl.engine.microbatch import (
    MicroBatch,
    compact_rows,
    plan_micro_batches,
    planned_micro_batches,
    scatter_outputs,
    span_starts_and_lengths,
)
from microrl.engine.moe import routing as moe_routing
from microrl.engine.offload import ActivationOffload, OffloadStats, release_pinned_memory
from microrl.engine.optim import (
    apply_optim_config,
    audit_grad_flow,
    audit_vision_tower,
    build_optimizer,
    build_scheduler,
    clip_and_check,
)
from microrl.engine.outputs import (
    StepResult,
    align_outputs,
    check_loss_result,
    check_step_result,
    last_token_index,
    split_fused_loss,
)
from microrl.engine.parallel import (
    cpu_offload,
    distributed,
    materialize,
    sequence_parallel,
    tensor_parallel,
)
from microrl.engine.parallel.varlen_attention import PACKED_LENGTHS_KWARG, enable_varlen_attention
from microrl.engine.validation import GROUP_KEY, check_batch
from microrl.losses.aggregation import LossDenominators, global_denominators
from microrl.losses.metrics import Metric, reduce_metrics

__all__ = ["Engine", "LossFn"]

logger = logging.getLogger(__name__)

# loss_fn(output, micro_batch, denominators) -> (partial loss, metrics); `output` holds the
# micro-batch's token-aligned model outputs *with* their graph, `micro_batch` its inputs, both in
# the same compact [b, L] layout.
LossFn = Callable[
    [TensorDict, TensorDict, LossDenominators], tuple[torch.Tensor, dict[str, Metric]]
]


class Engine:
    """Base engine: owns the module, the optimizer, the LR schedule and the micro-batch loop.

    Args:
        model: a transformers causal LM (``PreTrainedModel``) or a local checkpoint directory.
        config: an :class:`~microrl.configs.EngineConfig` (or a role's subclass of it).
        frozen: a scoring-only engine: weights in its compute dtype
            (:func:`~microrl.engine.setup.frozen_dtype`), all frozen, no optimizer; training
            calls raise ``RuntimeError``.
    """

    #: per-token ``[B, T]`` batch keys the default loss needs (besides ids and mask).
    loss_keys: tuple[str, ...] = ("loss_mask",)
    #: per-row ``[B]`` batch keys the default loss needs (validated as ``[B]``, indexed by row).
    row_keys: tuple[str, ...] = ()
    #: the key the global denominators count (docs/engine.md#sequence-level-roles): ``loss_mask``
    #: ``[B, T]``, or a per-row key of :attr:`row_keys`; a custom ``loss_fn`` needs it too.
    count_key: str = "loss_mask"
    config_class: type[EngineConfig] = EngineConfig

    def __init__(
        self, model: nn.Module | str | os.PathLike, config: EngineConfig, *, frozen: bool = False
    ) -> None:
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.config_class.__name__}, "
                f"got {type(config).__name__}"
            )
        self.config = config
        self.frozen = frozen
        vision.refuse_parallel(model, config)
        #: the data-parallel process group: an initialised one, or one started from torchrun's
        #: environment; None in a single process. First, so each rank picks its own GPU.
        self.dp_group: dist.ProcessGroup | None = distributed.init_distributed()
        self.device = setup.resolve_device(config)
        #: the ``("dp", "tp")`` (or ``("dp", "sp")``) device mesh, else None (docs/distributed.md).
        self.device_mesh = tensor_parallel.init_mesh(config.tensor_parallel_size, self.device)
        #: the sequence-parallel group (its ranks split every micro-batch's tokens), else None.
        self.sp_group: dist.ProcessGroup | None = None
        if config.sequence_parallel_size > 1:
            self.device_mesh = sequence_parallel.init_mesh(
                config.sequence_parallel_size, self.device
            )
            self.sp_group = self.device_mesh["sp"].get_group()
        if self.device_mesh is not None:
            self.dp_group = self.device_mesh["dp"].get_group()
        self.global_step = 0
        # A checkpoint path under torchrun: rank 0 reads it (engine/parallel/materialize.py).
        self._rank0_loading = isinstance(model, (str, os.PathLike)) and distributed.is_distributed()
        # Set before the model reaches the device: a 16-bit base never sits there in fp32.
        base_dtype = setup.frozen_dtype(config, self.device) if frozen else setup.base_dtype(config)
        if self._rank0_loading:
            causal_lm = materialize.load_on_rank0(model, base_dtype, self._load_model)
        else:
            causal_lm = self._load_model(model, base_dtype).to(self.device)
        self.vocab_size = causal_lm.get_input_embeddings().num_embeddings
        if config.disable_dropout:  # before LoRA: the adapters' own dropout is the user's choice
            zeroed = setup.disable_dropout(causal_lm)
            if zeroed:
                logger.info("disable_dropout: set %d dropout rates to 0", len(zeroed))
            if config.lora.rank and config.lora.dropout > 0:
                logger.warning(
                    "lora.dropout=%s keeps the training forward stochastic: on-policy ratios "
                    "will not be 1 (disable_dropout leaves the adapters' dropout as configured)",
                    config.lora.dropout,
                )
        #: a vision-language model's :class:`~microrl.engine.vision.VisionSpec`, else None.
        self.vision = vision.vision_spec(causal_lm)
        frozen_tower = self.vision is not None and config.freeze_vision
        if self.vision is None and not config.freeze_vision:
            raise ValueError(
                f"{vision.config_key(config, 'freeze_vision')}=False, but "
                f"{type(causal_lm).__name__} has no vision tower"
            )
        causal_lm, self.peft_model = setup.apply_lora(
            causal_lm,
            config.lora,
            exclude=self.vision.tower_module_names(causal_lm) if frozen_tower else None,
        )
        if frozen_tower:  # a full fine-tune trains the rest of the model
            self.vision.tower.requires_grad_(False)
        #: a mixture-of-experts model's routing (docs/engine.md#mixture-of-experts), else None.
        self.routing = moe.EngineRouting.of(causal_lm, config)
        # Data parallel: every rank runs the sharded tower on every micro-batch (placeholder image).
        self._tower_every_micro_batch = self.vision is not None and self.dp_group is not None
        if config.gradient_checkpointing:
            setup.enable_gradient_checkpointing(causal_lm)
        # Packed rows on SDPA/eager: attention per sequence (flash-attention does it natively).
        self._varlen_attention = config.pack_sequences and enable_varlen_attention(causal_lm)
        #: the transformers model (with LoRA layers injected), e.g. for ``generate``.
        self.model = causal_lm
        module = self._build_module(causal_lm)
        if frozen:
            module.requires_grad_(False)
        full_state = materialize.take_full_state(module) if self._rank0_loading else None
        #: the trained nn.Module: the role's wrapper, possibly sharded.
        self.module = self._wrap_model(module)
        if full_state is not None:
            materialize.load_full_state(self.module, full_state, self.device)
            distributed.finish_sharding(self.module)
        # Sequence-level roles opt in to the last real token's index by naming the parameter.
        self._passes_last_index = "last_index" in inspect.signature(self._model_forward).parameters
        self.optimizer = None if frozen else build_optimizer(self._trainable_params(), config.optim)
        self.lr_scheduler = None if frozen else build_scheduler(self.optimizer, config.optim)
        #: what activation offload moved in the last training ``forward_step`` (None when off).
        self.last_offload_stats: OffloadStats | None = None

    # ----------------------------------------------------------------- role hooks (override)
    def _load_model(self, model: nn.Module | str | os.PathLike, dtype: torch.dtype) -> nn.Module:
        """The transformers model the role is built on (a causal LM), its frozen weights in
        ``dtype``, on the CPU; under rank-0 loading only global rank 0 calls it."""
        return setup.load_causal_lm(model, dtype)

    def _build_module(self, causal_lm: nn.Module) -> nn.Module:
        """The role's ``nn.Module`` around the causal LM; :meth:`_model_forward` calls it once."""
        raise NotImplementedError

    def _model_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        targets: torch.Tensor,
        *,
        training: bool,
        temperature: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        """One call of :attr:`module` on a compact micro-batch of ``b`` sequences
        (docs/engine.md#writing-a-role).

        Returns a dict of tensors, each per-position, shaped like ``input_ids`` (``[b, L]``, or
        ``[1, N]`` packed) and aligned to the *predicting* position (the loop masks, unpacks and
        shifts it to token alignment), or per-row ``[b]`` in row order (returned as ``[B]``).
        ``targets[b, j]``: the token after position ``j`` (``-100`` where none); ``temperature``:
        the batch's, shaped like ``targets``, or None (the configured one); ``model_kwargs`` go to
        the transformers forward. An override declaring ``last_index`` gets each sequence's last
        real token's index ``[b]`` in ``input_ids.flatten()``
        (:func:`~microrl.engine.outputs.last_token_index`).
        """
        raise NotImplementedError

    def _module_forward(
        self, *inputs: torch.Tensor | None, training: bool, temperature: Any = None, **kw: Any
    ) -> torch.Tensor:
        """:attr:`module` on ``inputs[:3]`` (ids, positions, mask) and the model kwargs: the
        :meth:`_model_forward` of a head that reads neither ``targets`` nor ``temperature``."""
        return self.module(*inputs[:3], **kw)

    def default_loss(
        self, output: TensorDict, micro_batch: TensorDict, denominators: LossDenominators
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """The role's configured loss (used when ``loss_fn`` is None)."""
        raise NotImplementedError

    def fuses_loss(self, loss_fn: LossFn | None, *, training: bool = True) -> bool:
        """Whether a pass with ``loss_fn`` (None: :meth:`default_loss`) runs its loss inside the
        module (docs/engine.md#the-fused-loss-path). A role returning True gets a
        :class:`~microrl.engine.group_loss.GroupLoss` as ``group_loss`` and returns the loss (0-d,
        with its graph) among its outputs under :data:`~microrl.engine.outputs.FUSED_LOSS_KEY`."""
        return False

    # ----------------------------------------------------------------- hooks for distributed
    def _wrap_model(self, module: nn.Module) -> nn.Module:
        """Shard/wrap the role module after LoRA and checkpointing; unchanged when not distributed."""
        offload = cpu_offload.offload_policy(self.device) if self.config.optim.cpu_offload else None
        if self.sp_group is not None:  # FSDP2 over the dp x sp ranks, with the policy if set
            return sequence_parallel.wrap(module, self.device_mesh, offload_policy=offload)
        if self.device_mesh is not None:
            return tensor_parallel.wrap(module, self.device_mesh)
        if self.dp_group is None:
            if offload is None:
                return module
            cpu_offload.single_process_group(self.device)  # FSDP2 over one rank, for the policy
        return distributed.shard_model(module, offload_policy=offload)

    def _from_rank0(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` (a set-up decision that needs real weights, e.g. a numerical probe); under
        rank-0 loading only rank 0 has them: its result, shared with every rank."""
        if not self._rank0_loading:
            return compute()
        return materialize.share_from_rank0(compute() if distributed.rank() == 0 else None)

    def _agree_num_micro_batches(self, n: int) -> int:
        """The micro-batch count every DP rank will run (the max over ranks); ``n`` locally."""
        if self.dp_group is None:
            return n
        return distributed.agree_num_micro_batches(n, self.dp_group)

    # ----------------------------------------------------------------- public API
    def forward_backward_batch(
        self,
        batch: TensorDict | Mapping[str, torch.Tensor],
        loss_fn: LossFn | None = None,
        forward_only: bool = False,
    ) -> dict[str, Any]:
        """Run a whole mini-batch in micro-batches; accumulate gradients unless ``forward_only``.

        Args:
            batch: ``[B, T]`` TensorDict (docs/batch.md); the loss keys are required unless
                ``forward_only`` (then the loss is computed only when they are present).
            loss_fn: a :data:`LossFn` (``denominators``: the mini-batch's global counts); None
                uses :meth:`default_loss`.
            forward_only: no gradients, eval mode (old/ref log-probs, values).

        Returns:
            ``{"model_output": TensorDict [B, T] fp32 detached in the caller's row order,
            "loss": float, "metrics": dict[str, float]}``; a MIN/MAX metric without a value is NaN.
        """
        return self._forward_backward(batch, loss_fn, forward_only)[0]

    def _forward_backward(
        self,
        batch: TensorDict | Mapping[str, torch.Tensor],
        loss_fn: LossFn | None,
        forward_only: bool,
    ) -> tuple[dict[str, Any], LossDenominators | None]:
        """:meth:`forward_backward_batch` and the global denominators it used (None without a
        loss), which tell :meth:`train_batch` whether the mini-batch had any loss token."""
        if not forward_only:
            self._check_trains()
        # Data parallel: a rank whose share is empty still runs the agreed micro-batches (FSDP's
        # collectives), on a one-token placeholder row that contributes nothing.
        placeholder = self.dp_group is not None and distributed.is_empty_batch(batch)
        if placeholder:
            batch = distributed.placeholder_row(batch)
        batch = self._checked(batch, loss_fn, forward_only, role_checks=not placeholder)
        with_loss = self._has_loss_inputs(batch, loss_fn)
        starts, lengths = span_starts_and_lengths(batch["attention_mask"])
        host_lengths, host_groups = _host_lengths_and_groups(batch, lengths)
        # docs/losses.md: counted over the whole mini-batch (and all ranks) first.
        denominators = self._denominators(batch) if with_loss else None
        plan = self._plan(host_lengths, host_groups)
        shape = tuple(batch["input_ids"].shape)
        micro_batches = partial(
            planned_micro_batches,
            batch,
            plan,
            (starts, lengths),
            host_lengths,
            filler_count_key=self.count_key if with_loss else None,
            placeholder=placeholder,
        )
        outputs: dict[str, torch.Tensor] = {}
        losses, metrics = [], []
        # A mixture-of-experts model's router hooks, installed for the whole pass.
        with nullcontext() if self.routing is None else self.routing.hooks.installed():
            if denominators is not None and self.routing is not None:
                denominators = self._with_router(denominators, batch, micro_batches, placeholder)
            # One mode for the whole pass: a checkpointed layer recomputes in backward as it ran.
            with self._mode(training=not forward_only):
                for index, (rows, micro) in enumerate(micro_batches()):
                    step = check_step_result(
                        self.forward_step(micro, loss_fn, forward_only, denominators=denominators),
                        type(self).__name__,
                    )
                    if step.loss is not None:
                        if not forward_only:
                            # FSDP: reduce gradients over ranks once, after the last micro-batch.
                            distributed.set_gradient_sync(self.module, index == len(plan) - 1)
                            step.loss.backward()
                        losses.append(step.loss.detach() / denominators.grad_scale)
                        metrics.append(step.metrics)
                    if not micro.filler:
                        scatter_outputs(step.output, rows, starts, lengths, outputs, shape)
            if denominators is not None and self.routing is not None:
                metrics.append(self.routing.pass_metrics(self.dp_group))
        if not forward_only and with_loss and self.config.check_grad_flow:
            self._audit_grad_flow(batch)
        if losses:
            metrics.append({"loss": Metric(torch.stack(losses).sum())})
        reduced = reduce_metrics(metrics, group=self.dp_group)
        if placeholder:  # the caller's [0, T] / [0] shapes, with the keys a real share would have
            outputs = {k: v.new_zeros((0, *shape[1 : v.dim()])) for k, v in step.output.items()}
            shape = (0, shape[1])
        result = {
            "model_output": TensorDict(outputs, batch_size=[shape[0]], device=self.device),
            "loss": reduced.pop("loss", 0.0),
            "metrics": reduced,
        }
        return result, denominators

    def forward_step(
        self,
        micro_batch: MicroBatch | TensorDict | Mapping[str, torch.Tensor],
        loss_fn: LossFn | None = None,
        forward_only: bool = False,
        *,
        denominators: LossDenominators | None = None,
    ) -> StepResult:
        """One micro-batch: forward, loss (when its inputs are present), detached outputs, metrics.

        Gets a planned :class:`~microrl.engine.microbatch.MicroBatch` and the mini-batch's
        ``denominators``, or a plain ``[b, T]`` batch run as its own mini-batch. Returns a
        :class:`~microrl.engine.outputs.StepResult` whose ``output`` is in ``micro_batch``'s layout
        (compact ``[b, L]`` for a ``MicroBatch``, else ``[b, T]``); an override must return the
        same (the loop raises ``TypeError`` otherwise).
        """
        if isinstance(micro_batch, MicroBatch):
            return self._forward_micro(micro_batch, loss_fn, forward_only, denominators)
        # A plain [b, T] batch: validated, compacted to one micro-batch, scattered back.
        batch = self._checked(micro_batch, loss_fn, forward_only, role_checks=True)
        starts, lengths = span_starts_and_lengths(batch["attention_mask"])
        host_lengths, rows = lengths.tolist(), range(batch.batch_size[0])
        micro = MicroBatch(
            compact_rows(batch, rows, starts, lengths, max(host_lengths)), host_lengths
        )
        loss, output, metrics = self._forward_micro(micro, loss_fn, forward_only, denominators)
        full: dict[str, torch.Tensor] = {}
        shape = tuple(batch["input_ids"].shape)
        scatter_outputs(output, rows, starts, lengths, full, shape)
        return StepResult(
            loss, TensorDict(full, batch_size=[shape[0]], device=self.device), metrics
        )

    def _forward_micro(
        self,
        micro: MicroBatch,
        loss_fn: LossFn | None,
        forward_only: bool,
        denominators: LossDenominators | None,
    ) -> StepResult:
        """:meth:`forward_step` of a planned micro-batch: outputs in its compact ``[b, L]``."""
        data, training = micro.data, not forward_only
        with_loss = self._has_loss_inputs(data, loss_fn)
        if with_loss and denominators is None:  # the micro-batch is its own mini-batch
            denominators = self._denominators(data)
            if self.routing is not None:
                denominators = self._with_router(denominators, data, lambda: [(None, micro)])
        # loss(output, rows): on rows of the micro-batch, with the mini-batch's denominators.
        compute_loss = partial(
            self._call_loss, loss_fn or self.default_loss, denominators=denominators
        )
        group_loss = None
        if with_loss and self.fuses_loss(loss_fn, training=training):
            group_loss = GroupLoss(
                data, micro.lengths, compute_loss, packed=self.config.pack_sequences
            )
        args, kwargs, position_shape, unpack = self._model_inputs(micro, group_loss)
        shard = None
        if self.sp_group is not None:  # this rank's 1/s of the tokens; outputs gathered back
            packed = micro.lengths if self.config.pack_sequences else None
            args, kwargs, shard = sequence_parallel.shard_model_inputs(
                args, kwargs, self.sp_group, packed
            )
        # Saved activations to host memory (config.activation_offload): training forwards only.
        offload = None
        if training and self.config.activation_offload:
            offload = ActivationOffload([*self.module.parameters(), *self.module.buffers()])
        router = None
        if self.routing is not None:  # replay armed and router outputs collected in the forward
            router = self.routing.micro_batch(
                micro,
                packed=self.config.pack_sequences,
                denominators=denominators if with_loss else None,
                keep=training and self.config.gradient_checkpointing,
            )
        grad = torch.no_grad() if forward_only else nullcontext()
        with self._mode(training=training), grad, offload or nullcontext():
            with (
                setup.autocast_context(self.config, self.device),
                router.forward() if router is not None else nullcontext(),
            ):
                raw = self._model_forward(*args, training=training, **kwargs)
            if group_loss is not None:  # the loss ran inside the head, one group at a time
                raw, fused_loss = split_fused_loss(raw, type(self).__name__)
            if shard is not None:
                raw = shard.gather_outputs(raw, type(self).__name__)
            _, has_next = next_token_targets(data["input_ids"], data["attention_mask"])
            aligned = align_outputs(
                raw, len(micro.lengths), position_shape, has_next, unpack, type(self).__name__
            )
            output = TensorDict(aligned, batch_size=[len(micro.lengths)], device=self.device)
            loss, metrics = None, {}
            if group_loss is not None:
                loss, metrics = fused_loss, group_loss.metrics()
            elif with_loss:
                loss, metrics = compute_loss(output, data)
            if router is not None:  # the router losses' partials (docs/losses.md#router-losses)
                loss, metrics = router.add_terms(loss, metrics)
        if offload is not None:
            self.last_offload_stats = offload.stats
            if metrics:  # host bytes offloaded, summed over micro-batches and ranks
                bytes_ = torch.full((), float(offload.stats.bytes), device=self.device)
                metrics = {**metrics, "offload/bytes": Metric(bytes_)}
        return StepResult(loss, output.detach(), metrics)

    def infer_batch(self, batch: TensorDict | Mapping[str, torch.Tensor]) -> TensorDict:
        """No grad, eval mode: the role's outputs ``[B, T]`` fp32 in the caller's row order."""
        return self.forward_backward_batch(batch, forward_only=True)["model_output"]

    def optimizer_step(self, *, has_loss_tokens: bool | torch.Tensor = True) -> float:
        """Clip to the global grad norm and step; returns the norm (before clipping; may be inf).

        A non-finite norm or a False ``has_loss_tokens`` (a bool or 0-d bool tensor: without a
        loss token AdamW would still move every parameter) skips the step: parameters, optimizer
        state, schedule and :attr:`global_step` untouched, gradients zeroed.
        """
        self._check_trains()
        norm = clip_and_check(self._trainable_params(), self.config.optim.grad_clip)
        norm_value = float(norm)  # one sync per optimizer step
        self.last_step_skipped = not math.isfinite(norm_value)
        if self.last_step_skipped:
            logger.warning("non-finite grad norm %s: optimizer step skipped", norm_value)
        elif not bool(has_loss_tokens):  # all ranks agree: the count was all-reduced
            self.last_step_skipped = True
            logger.warning("no loss token in the mini-batch (loss_mask all 0): step skipped")
        if not self.last_step_skipped:
            self.optimizer.step()
            self.lr_scheduler.step()
            self.global_step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm_value

    def release_host_memory(self) -> None:
        """Unpin the host blocks offloaded copies left cached (a no-op off CUDA or without
        offload); call it once a step's updates are done (between them the blocks are reused)."""
        if self.config.activation_offload or self.config.optim.cpu_offload:
            release_pinned_memory(self.device)

    def train_batch(
        self, batch: TensorDict | Mapping[str, torch.Tensor], loss_fn: LossFn | None = None
    ) -> dict[str, float]:
        """zero_grad + :meth:`forward_backward_batch` + :meth:`optimizer_step` (+ LR schedule).

        Returns the loss metrics plus ``loss``, ``grad_norm``, ``step_skipped`` (0/1, as in
        :meth:`optimizer_step`) and ``lr`` (the learning rate this step used).
        """
        self._check_trains()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        result, denominators = self._forward_backward(batch, loss_fn, forward_only=False)
        has_tokens = getattr(denominators, "has_loss_tokens", None)
        grad_norm = self.optimizer_step(has_loss_tokens=True if has_tokens is None else has_tokens)
        skipped = float(self.last_step_skipped)
        step = {"loss": result["loss"], "grad_norm": grad_norm, "step_skipped": skipped, "lr": lr}
        return {**result["metrics"], **step}

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Run the base weights (the reference policy) inside the block; LoRA is re-enabled after.
        ``RuntimeError`` without LoRA (the "reference" would silently be the trained policy)."""
        if self.peft_model is None:
            raise RuntimeError(
                "disable_adapter() needs LoRA (config.lora.rank > 0); with a full fine-tune the "
                "base weights are gone: use a separate frozen engine as the reference policy"
            )
        with self.peft_model.disable_adapter():
            yield

    def save_checkpoint(self, path: str | os.PathLike, *, timeout_s: float | None = None) -> None:
        """Save module, optimizer, LR schedule, step, RNG and config, atomically (under LoRA the
        trainable parameters only). Under data parallelism a failed rank makes every rank raise,
        a hung one after ``timeout_s`` (None: ``MICRORL_CHECKPOINT_TIMEOUT_S``, else 600 s)
        (docs/checkpoints.md)."""
        from microrl.engine import checkpoint

        checkpoint.save_checkpoint(path, step=self.global_step, **self._checkpoint_parts(timeout_s))

    def load_checkpoint(self, path: str | os.PathLike, *, timeout_s: float | None = None) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same model and config) and its step.

        Optimizer state comes from the checkpoint, its hyper-parameters (lr, betas, eps, weight
        decay, the schedule's base lr) from this engine's config: a changed lr takes effect."""
        from microrl.engine import checkpoint

        info = checkpoint.load_checkpoint(path, **self._checkpoint_parts(timeout_s))
        # Unchanged settings are written back as they were, so resuming stays exact.
        apply_optim_config(self.optimizer, self.lr_scheduler, self.config.optim)
        self.global_step = info.step

    def _checkpoint_parts(self, timeout_s: float | None) -> dict[str, Any]:
        """The keyword arguments :meth:`save_checkpoint` and :meth:`load_checkpoint` share."""
        return {
            "model": self.module,
            "optimizer": self.optimizer,
            "scheduler": self.lr_scheduler,
            "config": self.config,
            "timeout_s": timeout_s,
        }

    @property
    def uses_fused_kernel(self) -> bool:
        """Whether the head runs through the fused kernel (False for the eager path or a critic)."""
        return bool(getattr(self.module, "fused", False))

    # ----------------------------------------------------------------- internals
    def _check_trains(self) -> None:
        if self.frozen:
            raise RuntimeError(
                f"this {type(self).__name__} is frozen (frozen=True): it only scores "
                "(infer_batch, or forward_backward_batch with forward_only=True)"
            )

    def _loss_inputs(self, loss_fn: LossFn | None) -> tuple[str, ...]:
        """Batch keys a loss needs: the role's for the default loss, :attr:`count_key` for a custom
        one (the global denominators count it; the function itself reads what it wants)."""
        if loss_fn is not None:
            return (self.count_key,)
        keys = (*self.loss_keys, *self.row_keys)
        return keys if self.count_key in keys else (*keys, self.count_key)

    def _count_mask(self, batch: TensorDict) -> torch.Tensor:
        """What the global denominators count, as ``[B, T]`` (a per-row key as ``[B, 1]``)."""
        mask = batch[self.count_key]
        return mask.unsqueeze(1) if mask.dim() == 1 else mask

    def _check_role_batch(self, batch: TensorDict) -> None:
        """Role-specific value checks after :func:`check_batch` (e.g. a reward model's pairs);
        raises ``ValueError``. Runs once per public call, outside the micro-batch loop."""

    def _checked(
        self,
        batch: TensorDict | Mapping[str, torch.Tensor],
        loss_fn: LossFn | None,
        forward_only: bool,
        *,
        role_checks: bool,
    ) -> TensorDict:
        """The batch validated at the public boundary (:func:`check_batch`, then the role's own
        value checks unless ``role_checks`` is False, for a data-parallel placeholder row)."""
        required = () if forward_only else self._loss_inputs(loss_fn)
        batch = check_batch(
            batch,
            required=required,
            vocab_size=self.vocab_size,
            device=self.device,
            row_keys=self.row_keys,
        )
        if role_checks:
            self._check_role_batch(batch)
        if moe.ROUTED_EXPERTS_KEY in batch:
            if self.routing is None:
                raise ValueError(moe_routing.refusal(self.model))
            if role_checks:
                self.routing.check(batch)
        if self.sp_group is not None:
            sequence_parallel.check_same_batch(batch, self.sp_group)
        return vision.prepare_batch(batch, self.vision)

    def _audit_grad_flow(self, batch: TensorDict) -> None:
        """The grad-flow audit after a training pass (``config.check_grad_flow``), with the
        ``freeze_vision`` decision of a vision-language model (docs/engine.md#images)."""
        mode = self.config.check_grad_flow
        if self.vision is None:
            return audit_grad_flow(self.module, self._count_mask(batch), mode)
        tower = {id(p) for p in self.vision.tower.parameters()}
        images = vision.PIXEL_VALUES_KEY in batch and bool(batch[vision.IMAGE_GRID_KEY].any())
        has_images = torch.tensor(float(images), device=self.device)
        if self.dp_group is not None:
            has_images = distributed.all_reduce(has_images, dist.ReduceOp.MAX, self.dp_group)
        skip = () if bool(has_images) else tower
        audit_grad_flow(self.module, self._count_mask(batch), mode, skip=skip)
        key = vision.config_key(self.config, "freeze_vision")
        audit_vision_tower(self.module, tower, frozen=self.config.freeze_vision, key=key, mode=mode)

    def _has_loss_inputs(self, batch: TensorDict, loss_fn: LossFn | None) -> bool:
        return all(key in batch for key in self._loss_inputs(loss_fn))

    def _denominators(self, batch: TensorDict) -> LossDenominators:
        """The loss's global denominators: ``batch``'s counts summed over the data-parallel ranks."""
        denominators = global_denominators(
            self._count_mask(batch), seq_len_norm=self.config.seq_len_norm, group=self.dp_group
        )
        if self.sp_group is not None:  # FSDP averages over dp x sp ranks, the counts are dp's
            denominators = sequence_parallel.scale_denominators(
                denominators, self.config.sequence_parallel_size
            )
        return denominators

    def _with_router(
        self,
        denominators: LossDenominators,
        batch: TensorDict,
        micro_batches: Callable[[], Iterable[tuple[Any, MicroBatch]]],
        placeholder: bool = False,
    ) -> LossDenominators:
        """``denominators`` with a mixture-of-experts model's router counts over the mini-batch
        (docs/losses.md#router-losses), counted by a forward-only pass when needed."""

        def count() -> tuple[torch.Tensor, torch.Tensor]:
            micros = (micro for _, micro in micro_batches())
            return self.routing.count_pass(
                micros, self._forward_only, packed=self.config.pack_sequences
            )

        router = self.routing.denominators(
            batch, placeholder=placeholder, group=self.dp_group, count=count
        )
        return moe_routing.with_router(denominators, router)

    def _forward_only(self, micro: MicroBatch) -> None:
        """The router's counting pass on ``micro``: eval mode, no gradients, outputs dropped."""
        args, kwargs, _, _ = self._model_inputs(micro, None)
        autocast = setup.autocast_context(self.config, self.device)
        with self._mode(training=False), torch.no_grad(), autocast:
            self._model_forward(*args, training=False, **kwargs)

    def _trainable_params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _plan(self, lengths: list[int], groups: list[int] | None = None) -> list[list[int]]:
        kwargs = {
            "micro_batch_size": self.config.micro_batch_size,
            "max_tokens": self.config.max_tokens_per_micro_batch,
            "packed": self.config.pack_sequences,
            "groups": groups,
        }
        plan = plan_micro_batches(lengths, **kwargs)
        agreed = self._agree_num_micro_batches(len(plan))
        if agreed > len(plan):
            plan = plan_micro_batches(lengths, **kwargs, min_micro_batches=agreed)
        return plan

    def _model_inputs(
        self, micro: MicroBatch, group_loss: GroupLoss | None
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], tuple[int, ...], Callable | None]:
        """What :meth:`_model_forward` gets for a micro-batch: positional ``(input_ids,
        position_ids, attention_mask, targets)`` (packed into ``[1, N]`` under
        ``pack_sequences``), keyword arguments, the shape the per-position outputs come back in,
        and how to unpack them (None when padded)."""
        data = micro.data
        valid, ids, positions = data["attention_mask"], data["input_ids"], data["position_ids"]
        targets, has_next = next_token_targets(ids, valid)
        kwargs: dict[str, Any] = {}
        if self._passes_last_index:
            kwargs["last_index"] = last_token_index(valid, packed=self.config.pack_sequences)
        temperature = None
        if "temperature" in data:
            temperature = predicting_temperature(data["temperature"], has_next)
        if group_loss is not None:
            kwargs["group_loss"] = group_loss
        rope = data.get(vision.ROPE_KEY, None)
        if self.vision is not None:
            images = vision.image_inputs(data, self.vision)
            if images is None and self._tower_every_micro_batch:
                images = self.vision.placeholder_images(self.device)
            kwargs["images"] = images
        if not self.config.pack_sequences:
            if self.vision is not None:  # the model's own mRoPE positions [3, b, L]
                positions = vision.model_positions(positions, rope, packed=False)
            args = (ids, positions, valid.long(), targets)
            return args, {**kwargs, "temperature": temperature}, tuple(ids.shape), None
        index = packing.packed_index(valid, sum(micro.lengths))
        packed_positions = packing.pack(positions, index)
        if self.vision is not None:  # [4, 1, N]: per-sequence text positions, then mRoPE's
            packed_rope = None if rope is None else packing.pack(rope, index)
            packed_positions = vision.model_positions(packed_positions, packed_rope, packed=True)
        args = (packing.pack(ids, index), packed_positions, None, packing.pack(targets, index))
        if temperature is not None:
            temperature = packing.pack(temperature, index)
        if self._varlen_attention:
            kwargs[PACKED_LENGTHS_KWARG] = tuple(micro.lengths)
        unpack = lambda v: packing.unpack(v, index, valid)  # noqa: E731
        return args, {**kwargs, "temperature": temperature}, tuple(args[0].shape), unpack

    def _call_loss(
        self,
        loss_fn: LossFn,
        output: TensorDict,
        micro_batch: TensorDict,
        denominators: LossDenominators,
    ) -> tuple[torch.Tensor, dict[str, Metric]]:
        """The one call of a loss: its result checked (:func:`check_loss_result`), plus the
        metrics the role adds to every loss (:meth:`_role_metrics`)."""
        loss, metrics = check_loss_result(loss_fn(output, micro_batch, denominators))
        return loss, {**metrics, **self._role_metrics(output, micro_batch, denominators, metrics)}

    def _role_metrics(
        self,
        output: TensorDict,
        micro_batch: TensorDict,
        denominators: LossDenominators,
        metrics: dict[str, Metric],
    ) -> dict[str, Metric]:
        """Metrics a role reports with every loss, given what the loss reported (none here)."""
        return {}

    @contextmanager
    def _mode(self, *, training: bool) -> Iterator[None]:
        """Train mode for gradient passes, eval mode (no dropout) otherwise; restored after."""
        previous = self.module.training
        self.module.train(training)
        try:
            yield
        finally:
            self.module.train(previous)


def _host_lengths_and_groups(
    batch: TensorDict, lengths: torch.Tensor
) -> tuple[list[int], list[int] | None]:
    """The rows' lengths (and group ids, when the batch has them) on the host, in one read: the
    one sync that planning needs."""
    if GROUP_KEY not in batch:
        return lengths.tolist(), None
    host_lengths, host_groups = torch.stack([lengths, batch[GROUP_KEY].to(lengths.dtype)]).tolist()
    return host_lengths, host_groups
