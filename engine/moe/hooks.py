"""Forward hooks on a model's routers: replay recorded routing, collect what the router losses use.

Installed on the router instances for an engine pass (no class is patched), armed per
micro-batch; collection runs during the forward only. The routes stay armed after it, so a layer
recomputed in backward routes as the forward did, and adds nothing to the losses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle

from microrl.engine.moe.routers import RouterSite, gate_weights

__all__ = ["Collected", "RouterHooks"]


@dataclass
class Collected:
    """What the routers produced in one micro-batch's forward, per MoE layer: ``logits`` ``[N, E]``
    (with their graph), ``own`` ``[N, k]`` the router's own choice, ``used`` ``[N, k]`` the experts
    the tokens went through (the recorded ones under replay)."""

    logits: list[torch.Tensor] = field(default_factory=list)
    own: list[torch.Tensor] = field(default_factory=list)
    used: list[torch.Tensor] = field(default_factory=list)


class RouterHooks:
    """The engine's hooks on the routers of one model (``find_routers`` order)."""

    def __init__(self, routers: list[RouterSite]):
        self.routers = routers
        #: the armed micro-batch's recorded experts ``[N, L, k]`` int64 (-1: route it yourself).
        self.routes: torch.Tensor | None = None
        self.collected: Collected | None = None
        self._handles: list[RemovableHandle] = []
        self._depth = 0  # open installed() blocks: an engine pass, and a forward_step inside it

    @contextmanager
    def installed(self, *, keep: bool = False) -> Iterator[RouterHooks]:
        """The hooks on the routers inside the block (nested blocks change nothing); ``keep``: leave
        them armed after it, for a backward that recomputes checkpointed layers later."""
        if self._depth:
            yield self
            return
        self.remove()
        self._handles = [
            site.module.register_forward_hook(self._hook(index, site))
            for index, site in enumerate(self.routers)
        ]
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if not keep:
                self.remove()

    def remove(self) -> None:
        """Remove the hooks and disarm them."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.routes, self.collected = None, None

    @contextmanager
    def micro_batch(self, routes: torch.Tensor | None, *, collect: bool) -> Iterator[Collected]:
        """Arm the hooks for one micro-batch's forward: ``routes`` ``[N, L, k]`` to replay (None:
        each router routes itself); with ``collect`` the forward fills the yielded
        :class:`Collected`."""
        self.routes = routes
        collected = Collected()
        self.collected = collected if collect else None
        try:
            yield collected
        finally:
            self.collected = None

    def _hook(self, index: int, site: RouterSite):
        def hook(module, args, output):
            logits, weights, experts = output
            own = experts
            routes = self.routes
            if routes is not None:
                if routes.shape[0] != logits.shape[0]:
                    raise RuntimeError(
                        f"routing replay: {site.name} routes {logits.shape[0]} tokens, the armed "
                        f"micro-batch has {routes.shape[0]}"
                    )
                forced = routes[:, index]
                recorded = forced[:, :1] >= 0
                experts = torch.where(recorded, forced, own)
                weights = torch.where(recorded, gate_weights(site, logits, experts), weights)
            if self.collected is not None:
                self.collected.logits.append(logits)
                self.collected.own.append(own.detach())
                self.collected.used.append(experts.detach())
            return None if routes is None else (logits, weights, experts)

        return hook
