"""A mixture-of-experts engine's routing: replay, router losses over the mini-batch, metrics.

Per pass with a loss, :meth:`EngineRouting.denominators` counts the whole mini-batch's tokens,
rows and load fractions ``f`` over every DP rank first; :meth:`MicroBatchRouting.add_terms` adds
each micro-batch's router losses. docs/engine.md#mixture-of-experts, docs/losses.md#router-losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn

from microrl.engine.microbatch import MicroBatch
from microrl.engine.moe.hooks import Collected, RouterHooks
from microrl.engine.moe.routers import RouterSite, find_routers
from microrl.engine.moe.routes import ROUTED_EXPERTS_KEY, check_routes, micro_batch_routes
from microrl.engine.parallel import distributed
from microrl.engine.vision import config_key
from microrl.losses import router as router_losses
from microrl.losses.aggregation import LossDenominators
from microrl.losses.metrics import Metric, Reduce
from microrl.losses.router import RouterDenominators, expert_counts

__all__ = [
    "AGREEMENT",
    "AUX_LOSS",
    "ROUTED_AS_SAMPLED",
    "Z_LOSS",
    "EngineRouting",
    "MicroBatchRouting",
    "refusal",
    "with_router",
]

AUX_LOSS = "router/aux_loss"
Z_LOSS = "router/z_loss"
AGREEMENT = "router/agreement"
ROUTED_AS_SAMPLED = "router/routed_as_sampled"


def refusal(causal_lm: nn.Module) -> str:
    """Why a batch's routing key cannot be used with ``causal_lm``."""
    try:
        find_routers(causal_lm)
    except ValueError as error:
        return f"the batch carries {ROUTED_EXPERTS_KEY!r}, but {error}"
    return (
        f"the batch carries {ROUTED_EXPERTS_KEY!r} (a mixture-of-experts routing), but "
        f"{type(causal_lm).__name__} has no mixture-of-experts router: drop the key"
    )


class EngineRouting:
    """What an engine adds for a mixture-of-experts model; :meth:`of` builds it (or None)."""

    def __init__(self, routers: list[RouterSite], config) -> None:
        self.routers = routers
        self.hooks = RouterHooks(routers)
        self.coefs = config.router_loss
        self.replay = config.routing_replay
        self.num_experts = routers[0].num_experts
        #: used-expert counts ``[L, E]`` of the running pass (the load metrics), else None.
        self._load: torch.Tensor | None = None

    @classmethod
    def of(cls, causal_lm: nn.Module, config) -> EngineRouting | None:
        """The routing of ``causal_lm`` under ``config`` (None: dense or unsupported);
        ``ValueError`` when ``router_loss.*`` is set for a model without a supported router."""
        try:
            routers = find_routers(causal_lm)
            why = f"{type(causal_lm).__name__} has no mixture-of-experts router"
        except ValueError as error:
            routers, why = [], str(error)
        if not routers:
            if config.router_loss.enabled:
                key = config_key(config, "router_loss")
                raise ValueError(
                    f"{key}.aux_loss_coef / z_loss_coef must be 0 for this model: {why}"
                )
            return None
        return cls(routers, config)

    def check(self, batch: TensorDict) -> None:
        """Validate the batch's routing key if any (``routes.check_routes``)."""
        if ROUTED_EXPERTS_KEY in batch:
            check_routes(batch[ROUTED_EXPERTS_KEY], batch["attention_mask"], self.routers)

    def denominators(
        self,
        batch: TensorDict,
        *,
        placeholder: bool,
        group: dist.ProcessGroup | None,
        count: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> RouterDenominators:
        """The mini-batch's router denominators summed over the DP ranks (one all-reduce); starts
        the pass's load metrics. ``count()`` runs the counting pass when the load-balancing loss
        needs ``f`` without replay; ``placeholder``: this rank's share is empty."""
        real = batch["attention_mask"].to(torch.bool)
        if placeholder:
            real = torch.zeros_like(real)
        layers = len(self.routers)
        values = [real.sum() * layers]
        routes = batch.get(ROUTED_EXPERTS_KEY, None)
        recorded = None
        if routes is not None:
            recorded = (routes[..., 0] >= 0) & real.unsqueeze(-1)  # [B, T, L]
            values.append(recorded.sum())
        if self.coefs.aux_loss_coef > 0:
            if routes is not None and self.replay:  # the recorded experts are the ones used
                counts, rows = expert_counts(routes, recorded, self.num_experts), recorded.sum()
            else:
                counts, rows = count()
            values += [rows.reshape(1), counts]
        totals = torch.cat([v.to(torch.float64).reshape(-1) for v in values])
        if dist.is_available() and dist.is_initialized():
            totals = distributed.all_reduce(totals, group=group)
        n_recorded = totals[1] if routes is not None else None
        load = None
        if self.coefs.aux_loss_coef > 0:
            rows_at = 2 if routes is not None else 1
            load = totals[rows_at + 1 :] / totals[rows_at].clamp_min(1.0)
        self._load = torch.zeros(layers, self.num_experts, dtype=torch.float64, device=real.device)
        return RouterDenominators(totals[0].clamp_min(1.0), load, n_recorded)

    def count_pass(
        self,
        micro_batches: Iterable[MicroBatch],
        forward: Callable[[MicroBatch], None],
        *,
        packed: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward-only counting pass (each router's own top-k over real tokens, no grad): local
        expert counts ``[E]`` and routed rows (float64)."""
        counts, rows = None, None
        for micro in micro_batches:
            step = MicroBatchRouting(self, micro, packed=packed, denominators=None, collect=True)
            with step.forward():
                forward(micro)
            for used in step.collected.used:
                part = expert_counts(used, step.valid, self.num_experts)
                counts = part if counts is None else counts + part
            part = step.valid.sum().to(torch.float64) * len(self.routers)
            rows = part if rows is None else rows + part
        return counts, rows

    def micro_batch(
        self,
        micro: MicroBatch,
        *,
        packed: bool,
        denominators: LossDenominators | None,
        keep: bool = False,
    ) -> MicroBatchRouting:
        """One micro-batch's routing; ``keep``: hooks outlive its forward (checkpointing)."""
        router = None if denominators is None else denominators.router
        return MicroBatchRouting(
            self,
            micro,
            packed=packed,
            denominators=denominators,
            collect=router is not None,
            keep=keep,
        )

    def pass_metrics(self, group: dist.ProcessGroup | None) -> dict[str, Metric]:
        """Per MoE layer, the min and max expert share of top-k assignments; ends the pass."""
        load, self._load = self._load, None
        if load is None:
            return {}
        load = distributed.all_reduce(load, group=group)
        share = load / load.sum(dim=-1, keepdim=True).clamp_min(1.0)
        lows, highs = share.min(dim=-1).values.float(), share.max(dim=-1).values.float()
        metrics = {}
        for layer in range(len(self.routers)):
            metrics[f"router/layer{layer}/load_min"] = Metric(lows[layer], Reduce.MIN)
            metrics[f"router/layer{layer}/load_max"] = Metric(highs[layer], Reduce.MAX)
        return metrics

    def _add_load(self, used: list[torch.Tensor], valid: torch.Tensor) -> None:
        if self._load is None:
            return
        for layer, experts in enumerate(used):
            self._load[layer] += expert_counts(experts, valid, self.num_experts)


class MicroBatchRouting:
    """One micro-batch's routing: ``valid`` ``[N]``, recorded ``routes`` ``[N, L, k]`` (or None),
    what its forward collected, and its router loss terms."""

    def __init__(
        self,
        owner: EngineRouting,
        micro: MicroBatch,
        *,
        packed: bool,
        denominators: LossDenominators | None,
        collect: bool,
        keep: bool = False,
    ) -> None:
        self.owner = owner
        self.denominators = denominators
        self.collect = collect
        self.keep = keep
        data = micro.data
        mask = data["attention_mask"].to(torch.bool)
        num_tokens = sum(micro.lengths) if packed else None
        if packed:
            valid = torch.ones(num_tokens, dtype=torch.bool, device=mask.device)
        else:
            valid = mask.reshape(-1)
        #: the rows of the model's flattened tokens that are real (none in a filler micro-batch).
        self.valid = valid & (not micro.filler)
        self.routes = None
        if ROUTED_EXPERTS_KEY in data and not micro.filler:
            self.routes = micro_batch_routes(data[ROUTED_EXPERTS_KEY], mask, num_tokens)
        self.collected: Collected | None = None

    @contextmanager
    def forward(self) -> Iterator[None]:
        """The forward inside: recorded experts replayed, router outputs collected if asked."""
        replayed = self.routes if self.owner.replay else None
        hooks = self.owner.hooks
        with (
            hooks.installed(keep=self.keep),
            hooks.micro_batch(replayed, collect=self.collect) as collected,
        ):
            yield
        self.collected = collected if self.collect else None

    def add_terms(
        self, loss: torch.Tensor | None, metrics: dict[str, Metric]
    ) -> tuple[torch.Tensor | None, dict[str, Metric]]:
        """The micro-batch's loss plus its partial router losses (scaled), and its metrics plus the
        router metrics' partials; frees what the forward collected."""
        collected, self.collected = self.collected, None
        if collected is None:
            return loss, metrics
        router = self.denominators.router
        coefs, metrics, term = self.owner.coefs, dict(metrics), None
        for coef, name, partial in (
            (coefs.aux_loss_coef, AUX_LOSS, router_losses.load_balancing_partial),
            (coefs.z_loss_coef, Z_LOSS, router_losses.z_loss_partial),
        ):
            if coef > 0:
                value = partial(collected.logits, self.valid, router)
                metrics[name] = Metric(value.detach().float())
                term = coef * value if term is None else term + coef * value
        if router.n_recorded is not None:
            recorded = router.n_recorded.float()
            metrics[AGREEMENT] = Metric(self._agreement(collected.own) / recorded)
            metrics[ROUTED_AS_SAMPLED] = Metric(self._agreement(collected.used) / recorded)
        self.owner._add_load(collected.used, self.valid)
        if term is not None and loss is not None:
            loss = loss + (term * self.denominators.grad_scale).to(loss.dtype)
        return loss, metrics

    def _agreement(self, chosen: list[torch.Tensor]) -> torch.Tensor:
        """Recorded (token, layer) rows whose ``chosen`` ``[N, k]`` is the recorded set."""
        total = torch.zeros((), dtype=torch.float32, device=self.valid.device)
        if self.routes is None:
            return total
        for layer, experts in enumerate(chosen):
            recorded = self.routes[:, layer]
            same = (experts.sort(-1).values == recorded.sort(-1).values).all(-1)
            counted = same & (recorded[:, 0] >= 0) & self.valid
            total = total + counted.sum()
        return total


def with_router(denominators: LossDenominators, router: RouterDenominators) -> LossDenominators:
    """``denominators`` carrying the router's."""
    return dataclasses.replace(denominators, router=router)
