"""Input checks shared by the public loss functions (the public boundary of ``microrl.losses``).

Shape, dtype and device checks are free (no host sync). The non-finite check is one fused
reduction over every input, hence exactly one host sync per call; the engine may skip it with
``validate=False`` inside a hot loop once the batch has been checked.
"""

from __future__ import annotations

import dataclasses

import torch

from .aggregation import AggMode, LossDenominators


def check_denominators(denominators: object) -> LossDenominators:
    if not isinstance(denominators, LossDenominators):
        raise TypeError(
            "denominators must be the mini-batch's LossDenominators (from global_denominators); "
            f"got {type(denominators).__name__}"
        )
    return denominators


def check_agg_mode(agg_mode: AggMode | str, denominators: LossDenominators) -> AggMode:
    mode = AggMode.parse(agg_mode)
    if mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM and denominators.seq_len_norm is None:
        raise ValueError(
            "agg_mode 'seq-mean-token-sum-norm' needs denominators.seq_len_norm (the constant L)"
        )
    return mode


def check_token_inputs(
    loss_mask: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    *,
    validate: bool,
) -> torch.Tensor:
    """Check ``[B, T]`` per-token inputs against ``loss_mask``; return the mask as bool.

    Every tensor in ``tensors`` must be a floating ``[B, T]`` tensor with the shape, device and
    dtype of the first one. With ``validate``, every value at an *unmasked* position must be
    finite; masked positions may hold anything (they are removed with ``torch.where``).
    """
    if not isinstance(loss_mask, torch.Tensor):
        raise TypeError(f"loss_mask must be a torch.Tensor, got {type(loss_mask).__name__}")
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    if loss_mask.is_complex():
        raise ValueError(f"loss_mask must be bool, integer or float, got {loss_mask.dtype}")
    reference_name: str | None = None
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != loss_mask.shape:
            hint = ""
            if tensor.dim() == 1 and tensor.shape[0] == loss_mask.shape[0]:
                hint = " (a per-sequence [B] value: spread it with broadcast_to_tokens)"
            raise ValueError(
                f"{name} must have the shape of loss_mask {tuple(loss_mask.shape)}, "
                f"got {tuple(tensor.shape)}{hint}"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
        if tensor.device != loss_mask.device:
            raise ValueError(f"{name} is on {tensor.device} but loss_mask is on {loss_mask.device}")
        if reference_name is None:
            reference_name = name
        elif tensor.dtype != tensors[reference_name].dtype:
            raise ValueError(
                f"{name} has dtype {tensor.dtype} but {reference_name} has "
                f"{tensors[reference_name].dtype}; cast them to one dtype"
            )
    mask = loss_mask.to(torch.bool)
    if validate and tensors:
        check_finite(mask, tensors)
    return mask


def check_reward_inputs(
    response_mask: torch.Tensor, tensors: dict[str, torch.Tensor], fractions: dict[str, float]
) -> torch.Tensor:
    """The checks of the advantage estimators (GAE, REINFORCE++): each of ``tensors`` a float
    ``[B, T]`` of ``response_mask``'s shape, finite on the response tokens (one host sync), each
    of ``fractions`` (gamma, lambda) in [0, 1]; returns the mask as bool. Errors name the key."""
    for name, t in tensors.items():
        if t.shape != response_mask.shape or t.dim() != 2:
            raise ValueError(
                f"{name} must have the [B, T] shape of response_mask "
                f"{tuple(response_mask.shape)}, got {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    for name, x in fractions.items():
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {x}")
    mask = response_mask.to(torch.bool)
    check_finite(mask, tensors)
    return mask


def check_finite(mask: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """One fused check (a single host sync): every unmasked value of every tensor is finite."""
    flags = torch.stack(
        [
            torch.isfinite(
                torch.where(mask, t.detach(), torch.zeros((), dtype=t.dtype, device=t.device))
            ).all()
            for t in tensors.values()
        ]
    )
    if bool(flags.all()):
        return
    # Error path only: say which argument and where.
    for (name, tensor), ok in zip(tensors.items(), flags.tolist(), strict=True):
        if not ok:
            bad = mask & ~torch.isfinite(tensor.detach())
            count = int(bad.sum())
            first = [int(i) for i in bad.nonzero()[0].tolist()]
            raise ValueError(
                f"{name} has {count} non-finite value(s) at unmasked positions "
                f"(first at [b, t] = {first}: {tensor[first[0], first[1]].item()})"
            )


def check_finite_vectors(tensors: dict[str, torch.Tensor]) -> None:
    """The same fused check for unmasked tensors (e.g. per-sequence scores ``[B]``)."""
    flags = torch.stack([torch.isfinite(t.detach()).all() for t in tensors.values()])
    if bool(flags.all()):
        return
    for (name, tensor), ok in zip(tensors.items(), flags.tolist(), strict=True):
        if not ok:
            first = (~torch.isfinite(tensor.detach())).nonzero()[0].tolist()
            raise ValueError(f"{name} has non-finite values (first at index {first})")


def unscaled(denominators: LossDenominators) -> LossDenominators:
    """The same denominators without ``grad_scale``, for loss *metrics*: their partials sum over
    micro-batches and ranks to the mini-batch loss value itself."""
    if denominators.grad_scale == 1.0:
        return denominators
    return dataclasses.replace(denominators, grad_scale=1.0)
