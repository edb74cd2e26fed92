"""Record the experts a mixture-of-experts model routes every token through, for replay.

A sampler wraps ``model.generate`` in a :class:`RoutingRecorder`, which lays each forward's top-k
out as ``routed_experts`` ``[B, T, L, k]`` (docs/batch.md); a row's last token: ``-1`` (the
trainer routes it).
"""

from __future__ import annotations

import torch
from torch import nn

from microrl.engine.moe.routers import find_routers
from microrl.engine.moe.routes import NO_ROUTE, routes_dtype

__all__ = ["RoutingRecorder"]


class RoutingRecorder:
    """Forward hooks on ``model``'s routers while the ``with`` block runs::

        with RoutingRecorder(model) as recorder:
            sequences = model.generate(ids, attention_mask=mask, ...)
        routes = recorder.routes(len(ids), sequences.shape[1])  # [B, T, L, k], int16, on the CPU

    Consecutive forwards continue the same ``B`` rows in time (prefill, then decoding steps); the
    hooks only observe. ``ValueError`` for a model without a supported mixture-of-experts router.
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(
                f"RoutingRecorder: {type(model).__name__} has no mixture-of-experts router"
            )
        self._calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = []

    def __enter__(self) -> RoutingRecorder:
        self.clear()
        self._handles = [
            site.module.register_forward_hook(self._hook(layer))
            for layer, site in enumerate(self.routers)
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        """Forget what was recorded (a recorder is reusable, one batch per block)."""
        self._calls = [[] for _ in self.routers]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self._calls[layer].append(output[2].detach())

        return hook

    def routes(self, batch_size: int, length: int | None = None) -> torch.Tensor:
        """The recorded routing of ``batch_size`` rows, ``[B, T, L, k]`` on the CPU; ``length`` pads
        the token axis with ``-1`` or cuts forwards past a row's end (``synced_gpus``).
        ``ValueError``: nothing recorded, or a forward's token count is not a multiple of
        ``batch_size``."""
        if not self._calls[0]:
            raise ValueError("RoutingRecorder: no forward was recorded")
        top_k = self.routers[0].top_k
        layers = []
        for calls in self._calls:
            steps = []
            for experts in calls:
                if experts.shape[0] % batch_size:
                    raise ValueError(
                        f"RoutingRecorder: a forward routed {experts.shape[0]} tokens, not a "
                        f"multiple of batch_size={batch_size}"
                    )
                steps.append(experts.reshape(batch_size, -1, top_k))
            layers.append(torch.cat(steps, dim=1))
        dtype = routes_dtype(self.routers[0].num_experts)
        out = torch.stack(layers, dim=2).to(device="cpu", dtype=dtype)
        if length is None:
            return out
        if out.shape[1] >= length:
            return out[:, :length].contiguous()
        pad = out.new_full((batch_size, length - out.shape[1], *out.shape[2:]), NO_ROUTE)
        return torch.cat([out, pad], dim=1)
