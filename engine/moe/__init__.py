"""Mixture-of-experts models in the engine (docs/engine.md, "Mixture-of-experts"): ``routers``
(finding routers, each family's gating), ``routes`` (the ``routed_experts`` key), ``hooks``
(replay, collection), ``routing`` (router losses, metrics) and ``recorder`` (a sampler's routing).
"""

from microrl.engine.moe.recorder import RoutingRecorder
from microrl.engine.moe.routers import GateKind, RouterSite, find_routers, gate_weights
from microrl.engine.moe.routes import NO_ROUTE, ROUTED_EXPERTS_KEY, routes_dtype
from microrl.engine.moe.routing import EngineRouting

__all__ = [
    "NO_ROUTE",
    "ROUTED_EXPERTS_KEY",
    "EngineRouting",
    "GateKind",
    "RouterSite",
    "RoutingRecorder",
    "find_routers",
    "gate_weights",
    "routes_dtype",
]
