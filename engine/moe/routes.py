"""The per-token routing key ``routed_experts``: its layout, its checks, its micro-batch form.

``routed_experts[b, t, l, j]``: the ``j``-th expert MoE layer ``l`` chose for token
``input_ids[b, t]``, ``[B, T, L, k]`` in :func:`routes_dtype`, ``-1`` where nothing was
recorded; token-aligned, so batch plumbing carries it like any per-token key (docs/batch.md).
"""

from __future__ import annotations

import torch

from microrl.engine import packing
from microrl.engine.moe.routers import RouterSite

__all__ = ["NO_ROUTE", "ROUTED_EXPERTS_KEY", "check_routes", "micro_batch_routes", "routes_dtype"]

#: The batch key of the recorded routing (docs/batch.md).
ROUTED_EXPERTS_KEY = "routed_experts"
#: The entry of a (token, layer) with no recorded routing: the trainer routes it itself.
NO_ROUTE = -1


def routes_dtype(num_experts: int) -> torch.dtype:
    """int16 up to 32767 experts, int32 beyond."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def check_routes(routes: torch.Tensor, mask: torch.Tensor, routers: list[RouterSite]) -> None:
    """Validate a batch's ``routed_experts`` ``[B, T, L, k]`` against the model (one host sync);
    ``mask``: ``attention_mask`` ``[B, T]`` (padding is not checked).

    Raises:
        ValueError: a wrong shape for the model's ``L`` layers and top-``k``, a non-integer dtype,
            or on a real token an expert outside ``[-1, E)``, a partly recorded (token, layer) or a
            repeated expert: naming the row, token and layer.
    """
    layers, top_k = len(routers), routers[0].top_k
    expected = (*mask.shape, layers, top_k)
    if tuple(routes.shape) != expected:
        names = ", ".join(site.name for site in routers)
        raise ValueError(
            f"{ROUTED_EXPERTS_KEY!r} has shape {tuple(routes.shape)}; the model routes each token "
            f"through {layers} MoE layer(s) ({names}) with top-{top_k}: expected [B, T, L, k] = "
            f"{expected} (layer l of the key is the l-th of these routers)"
        )
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise ValueError(
            f"{ROUTED_EXPERTS_KEY!r} must be an integer tensor (int16: "
            f"{routes_dtype(routers[0].num_experts)} for this model), got {routes.dtype}"
        )
    real = mask.to(torch.bool)[:, :, None]
    ids = routes.long()
    recorded = ids >= 0
    sorted_ids = ids.sort(dim=-1).values
    checks = [
        (ids.lt(NO_ROUTE) | ids.ge(routers[0].num_experts)).any(-1),
        recorded.any(-1) & ~recorded.all(-1),
        recorded.all(-1) & (sorted_ids[..., 1:] == sorted_ids[..., :-1]).any(-1),
    ]
    messages = [
        f"an expert id outside [-1, {routers[0].num_experts})",
        f"some but not all of its {top_k} experts recorded (-1 marks a whole unrecorded layer)",
        "an expert chosen twice",
    ]
    bad = torch.stack([(flag & real).any() for flag in checks]).tolist()  # the one host sync
    for failed, flag, message in zip(bad, checks, messages, strict=True):
        if failed:
            row, token, layer = (flag & real).nonzero()[0].tolist()
            raise ValueError(
                f"{ROUTED_EXPERTS_KEY!r} row {row}, token {token}, layer {layer} "
                f"({routers[layer].name}) has {message}: {ids[row, token, layer].tolist()}"
            )


def micro_batch_routes(
    routes: torch.Tensor, valid: torch.Tensor, num_tokens: int | None
) -> torch.Tensor:
    """A compact micro-batch's routing in the model's token order: ``routes`` ``[b, L', l, k]`` and
    ``valid`` ``[b, L']`` -> int64 ``[N, l, k]`` (padded rows flattened, or packed, the real
    tokens); :data:`NO_ROUTE` on padding."""
    routes = torch.where(valid[:, :, None, None], routes.long(), NO_ROUTE)
    if num_tokens is not None:
        routes = packing.pack(routes, packing.packed_index(valid, num_tokens))
    return routes.reshape(-1, *routes.shape[2:])
