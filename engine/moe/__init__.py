"""Mixture-of-experts models in the engine (docs/engine.md, "Mixture-of-experts").

:mod:`~microrl.engine.moe.routers` finds a model's routers and knows each family's gating;
:mod:`~microrl.engine.moe.routes` the per-token routing key ``routed_experts`` (layout, checks,
micro-batch form); :mod:`~microrl.engine.moe.hooks` the engine's hooks on the routers (replay,
collection); :mod:`~microrl.engine.moe.routing` what a pass does with them (router losses over
the whole mini-batch, routing metrics); :mod:`~microrl.engine.moe.recorder` records the routing
a sampler's forwards choose.
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
