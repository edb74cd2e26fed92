"""The modules the engine differentiates: one ``nn.Module`` call from ids to per-token outputs.

Each wrapper owns the transformers model (or its body) and is the root the engine trains, so
FSDP2 on it unshards the lm-head weight before its forward. Outputs are aligned to the
*predicting* position: entry ``[.., j]`` concerns token ``j + 1``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from microrl.engine.alignment import IGNORE_INDEX
from microrl.engine.vision import ImageInputs, body_hidden, multimodal_body
from microrl.kernels import fused_linear_logprob, fused_linear_loss, reference_linear_logprob
from microrl.kernels.fused_loss import GroupLossFn

__all__ = [
    "LogitTransform",
    "PolicyModel",
    "ValueModel",
    "decoder_body",
    "fp32_linear",
    "fused_head_blocker",
    "gather_last",
    "logit_transform",
]

logger = logging.getLogger(__name__)


# Config attributes that change the logits after the lm-head matmul (``logit_transform``); the
# probe still checks them: a family using a name differently falls back to the eager path.
_SOFTCAP_ATTR = "final_logit_softcapping"
_MULTIPLY_ATTR = "logit_scale"
_DIVIDE_ATTR = "logits_scaling"
# Logit transforms the kernel does not reproduce: a non-trivial value blocks the fused path.
_LOGIT_TRANSFORM_ATTRS = (
    "logit_softcapping",
    "logit_multiplier",
    "output_multiplier_scale",
    "lm_head_multiplier",
    "mup_width_multiplier",
    "width_multiplier",
    "dim_model_base",
)
# The probe's tolerance: both sides run the same fp32 ops, so more than rounding is a transform.
_PROBE_RTOL = 1e-4
_PROBE_TOKENS = 8  # a handful of tokens suffice to reveal a transformation of the logits


def decoder_body(causal_lm: nn.Module) -> nn.Module:
    """The model without its head (``get_decoder()``), returning ``last_hidden_state``; for a
    vision-language model the multimodal body (vision tower + language model)."""
    body = multimodal_body(causal_lm)
    if body is not None:
        return body
    get = getattr(causal_lm, "get_decoder", None)
    body = get() if callable(get) else None
    if body is None or body is causal_lm:
        raise TypeError(
            f"{type(causal_lm).__name__} exposes no decoder body (get_decoder()); the engine needs "
            "a transformers causal LM"
        )
    return body


@dataclass(frozen=True)
class LogitTransform:
    """What the model does to ``z = lm_head(hidden)`` before its logits come out:
    ``cap(z * scale)`` with ``cap(x) = softcap * tanh(x / softcap)`` (identity for None)."""

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """The transform in eager torch (the probe's model of the kernel)."""
        z = z * self.scale if self.scale != 1.0 else z
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap


def logit_transform(causal_lm: nn.Module) -> LogitTransform:
    """The logit transform the config declares (Gemma 2/3 ``final_logit_softcapping``, Cohere
    ``logit_scale``, Granite ``logits_scaling``), else identity; ``ValueError`` for a value that is
    not a finite number > 0 or another non-trivial logit transform (muP-style multipliers...)."""
    config = getattr(causal_lm, "config", None)
    for attr in _LOGIT_TRANSFORM_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)) and value not in (0, 1):
            raise ValueError(f"config.{attr} = {value} transforms the logits")

    def positive(attr: str) -> float | None:
        value = getattr(config, attr, None)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config.{attr} = {value!r} is not a number")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"config.{attr} = {value} is not a finite number > 0")
        return float(value)

    multiply, divide = positive(_MULTIPLY_ATTR), positive(_DIVIDE_ATTR)
    scale = (1.0 if multiply is None else multiply) / (1.0 if divide is None else divide)
    return LogitTransform(scale=scale, softcap=positive(_SOFTCAP_ATTR))


def fused_head_blocker(causal_lm: nn.Module) -> str | None:
    """Why the fused kernel (``log_softmax(cap((hidden @ W.T + b) * scale) / T)``) would not be
    exact for this model, or ``None``: checks the head's type, the config and a tiny numerical
    probe."""
    head = causal_lm.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"the lm head is a {type(head).__name__}, not a plain nn.Linear"
    try:
        transform = logit_transform(causal_lm)
        body = decoder_body(causal_lm)
    except (TypeError, ValueError) as error:
        return str(error)
    return _probe_logits(causal_lm, body, head, transform)


@torch.no_grad()
def _probe_logits(
    causal_lm: nn.Module, body: nn.Module, head: nn.Linear, transform: LogitTransform
) -> str | None:
    was_training = causal_lm.training
    causal_lm.eval()
    try:
        device = head.weight.device
        ids = torch.arange(_PROBE_TOKENS, device=device).unsqueeze(0) % head.out_features
        # No padding here, but GPT-2-style models warn about pad-like ids without a mask.
        mask = torch.ones_like(ids)
        logits = causal_lm(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        hidden = body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        direct = transform.apply(F.linear(hidden, head.weight, head.bias).float())
    finally:
        causal_lm.train(was_training)
    scale = direct.abs().max().clamp_min(1e-6)
    if logits.shape != direct.shape or (logits - direct).abs().max() > _PROBE_RTOL * scale:
        return (
            "the model's logits differ from the kernel's transform of lm_head(final hidden state)"
        )
    return None


class PolicyModel(nn.Module):
    """Causal LM -> per-position log-probs of the next token (and the entropy of its distribution).

    ``fused=True``: body, then :func:`microrl.kernels.fused_linear_logprob` with the head's weight,
    bias and logit transform, so the ``[N, V]`` logits never exist. ``fused=False`` with
    ``plain_head=True``: the kernel's eager twin :func:`microrl.kernels.reference_linear_logprob`
    (fp32 rounding apart from the fused one). Otherwise the model's own forward, then an fp32
    ``log_softmax`` (docs/engine.md#head-paths). ``trusted_targets=True``: the caller validated
    targets and temperatures, so the kernel skips its checks and host sync.
    """

    def __init__(
        self,
        causal_lm: nn.Module,
        *,
        fused: bool,
        plain_head: bool | None = None,
        chunk_size: int | None = None,
        trusted_targets: bool = False,
    ):
        super().__init__()
        self.causal_lm = causal_lm
        self.fused = fused
        # The fused kernel needs a plain head; the eager path uses it whenever the head is plain.
        self.plain_head = fused if plain_head is None else (plain_head or fused)
        # Config values, read once (the bias is read per forward: unsharded by then).
        self.logit_transform = logit_transform(causal_lm) if self.plain_head else None
        self.chunk_size = chunk_size
        self.trusted_targets = trusted_targets

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float | torch.Tensor = 1.0,
        with_entropy: bool = True,
        loss_fn: GroupLossFn | None = None,
        loss_segments: list[int] | None = None,
        images: ImageInputs | None = None,
        **model_kwargs: Any,
    ) -> tuple[torch.Tensor, ...]:
        """``[b, L]`` tensors (``attention_mask`` None for packed rows) -> fp32 ``[b, L]``.

        ``targets[b, j]`` is the token predicted from position ``j`` (``-100``: none, output 0).
        ``loss_fn`` (fused head only): the loss runs inside the head (:func:`fused_linear_loss`, row
        groups never splitting ``loss_segments``), returning ``(logprobs, entropy, loss)``.
        ``images``: a vision-language model's (``position_ids`` then its mRoPE positions).
        """
        inputs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
            "use_cache": False,
            **model_kwargs,
        }
        if self.plain_head:
            hidden = body_hidden(decoder_body(self.causal_lm), images, **inputs)
            # The head upcasts mixed dtypes to fp32: logits are never rounded to 16 bits.
            lm_head = self.causal_lm.get_output_embeddings()
            weight, transform = lm_head.weight, self.logit_transform
            # Targets below the input vocabulary are in range only if the head is at least as wide.
            in_range = weight.shape[0] >= self.causal_lm.get_input_embeddings().num_embeddings
            head = fused_linear_logprob if self.fused else reference_linear_logprob
            if loss_fn is not None:  # returned as a tuple: a sharding wrapper hooks its tensors
                if not self.fused:
                    raise ValueError("loss_fn needs the fused head (use_fused_kernel=True)")
                head = _fused_loss_head(loss_fn, loss_segments)
            if isinstance(weight, DTensor):  # tensor parallel: Shard(0) over the vocabulary
                head = _vocab_parallel_head(loss_fn, loss_segments)
            return head(
                hidden,
                weight,
                targets,
                temperature=temperature,
                with_entropy=with_entropy,
                chunk_size=self.chunk_size,
                validate=not (self.trusted_targets and in_range),
                bias=getattr(lm_head, "bias", None),
                logit_scale=transform.scale,
                softcap=transform.softcap,
            )
        if images is not None:  # only plain-head models are vision-language ones here
            raise ValueError("images need the plain lm head path (a Qwen-VL model has one)")
        logits = self.causal_lm(**inputs).logits
        return eager_logprob(logits, targets, temperature, with_entropy)


def _fused_loss_head(loss_fn: GroupLossFn, segments: list[int] | None):
    """:func:`fused_linear_loss` as a head -> ``(logprobs, entropy, loss)``."""

    def head(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        out = fused_linear_loss(*args, loss_fn, segments=segments, **kwargs)
        return out.logprobs, out.entropy, out.loss

    return head


def _vocab_parallel_head(loss_fn: GroupLossFn | None, segments: list[int] | None):
    """:func:`microrl.kernels.vocab_parallel_linear_logprob` (weight and bias ``Shard(0)`` DTensors
    over the tp ranks) with the fused head's signature; with ``loss_fn``, its fused-loss twin."""

    def head(hidden, weight, targets, **kwargs):
        from microrl.kernels import vocab_parallel_linear_logprob
        from microrl.kernels.vocab_parallel_loss import vocab_parallel_linear_loss

        if loss_fn is None:
            return vocab_parallel_linear_logprob(hidden, weight, targets, **kwargs)
        out = vocab_parallel_linear_loss(
            hidden, weight, targets, loss_fn, segments=segments, **kwargs
        )
        return out.logprobs, out.entropy, out.loss

    return head


def eager_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(logits / T)`` at ``targets`` (fp32) and the distribution's entropy."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = temperature.unsqueeze(-1)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    valid = targets != IGNORE_INDEX
    picked = logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=picked.dtype, device=picked.device)
    logprobs = torch.where(valid, picked, zero)
    entropy = None
    if with_entropy:
        entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), zero)
    return logprobs, entropy


def gather_last(values: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """Each sequence's entry at its last real token: ``[b, L, ...]`` (or packed ``[1, N, ...]``) and
    flat ``last_index [b]`` -> ``[b, ...]``. Differentiable; no host sync."""
    return values.flatten(0, 1).index_select(0, last_index)


class ValueModel(nn.Module):
    """Decoder body -> a scalar per position, or per sequence, through a ``Linear(H, 1)`` head.

    The head starts from ``N(0, 1/(H+1))`` weights (not zero: the body would get no gradient) and a
    zero bias. ``bias``: the critic's head has one; a Bradley-Terry reward model's does not (its
    loss sees only score differences). ``sequence_level``: False, a value per position; True, one
    score per sequence at its last real token, given ``last_index``.
    """

    def __init__(
        self,
        body: nn.Module,
        hidden_size: int,
        *,
        seed: int = 0,
        bias: bool = True,
        sequence_level: bool = False,
    ):
        super().__init__()
        self.body = body
        self.sequence_level = sequence_level
        param = next(body.parameters())
        # The head follows the body's parameter dtype (fp32 by default; fp64 in exactness tests).
        dtype = param.dtype if param.dtype == torch.float64 else torch.float32
        self.value_head = nn.Linear(hidden_size, 1, bias=bias, device=param.device, dtype=dtype)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        std = 1.0 / math.sqrt(hidden_size + 1)
        weight = torch.randn(self.value_head.weight.shape, generator=generator, dtype=dtype) * std
        with torch.no_grad():
            self.value_head.weight.copy_(weight)
            if bias:
                self.value_head.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        last_index: torch.Tensor | None = None,
        images: ImageInputs | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """``[b, L]`` ids -> ``[b, L]`` fp32 values, or ``[b]`` with ``last_index``."""
        hidden = body_hidden(
            self.body,
            images,
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **model_kwargs,
        )
        if last_index is not None:
            hidden = gather_last(hidden, last_index)
        return fp32_linear(hidden, self.value_head).squeeze(-1)


def fp32_linear(hidden: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(hidden)`` in float32 outside autocast (float64 for a float64 weight), so a scalar
    head's value is never rounded to 16 bits: ``[..., H]`` -> ``[..., out]``."""
    dtype = torch.float64 if linear.weight.dtype == torch.float64 else torch.float32
    weight, bias = _replicated_local(linear.weight), _replicated_local(linear.bias)
    bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return F.linear(hidden.to(dtype), weight.to(dtype), bias)


def _replicated_local(param: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor-parallel replicated parameter as this rank's plain tensor."""
    return param.to_local() if isinstance(param, DTensor) else param
