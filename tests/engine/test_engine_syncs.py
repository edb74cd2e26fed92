"""No host sync inside the micro-batch loop from the engine's own code (docs/engine.md).

A host sync shows up at the dispatcher as ``_local_scalar_dense`` (``.item()``, ``bool()``),
``nonzero`` / ``masked_select``, or an index with a boolean mask; ``.tolist()`` of a CPU tensor
reads memory without any dispatch (on an accelerator it is a sync), so it is counted by wrapping
``Tensor.tolist``. Each one is attributed to the innermost non-torch Python frame that issued it;
those issued by ``microrl/engine`` or by the fused lm-head kernel (``microrl/kernels``, which the
engine calls with ``validate=False`` once the batch's token ids are validated) must not grow with
the number of micro-batches (transformers' mask construction is theirs, not the loop's).
"""

from __future__ import annotations

import collections

import pytest
import torch
from engine_utils import make_batch, tiny_model
from moe_utils import NUM_EXPERTS, NUM_LAYERS, TOP_K, tiny_moe
from sync_utils import count_syncs

from microrl.configs import ActorConfig, CriticConfig
from microrl.engine import ActorEngine, CriticEngine
from microrl.engine.moe import ROUTED_EXPERTS_KEY
from microrl.losses import RouterLossConfig


def _count(engine_cls, config, moe: str | None = None) -> collections.Counter[str]:
    engine = engine_cls(tiny_moe() if moe else tiny_model(), config)
    batch = make_batch(6, 10, seed=40)
    if moe == "replay":  # routing replay from a recorded key (the aux loss counts it)
        scores = torch.rand(6, 10, NUM_LAYERS, NUM_EXPERTS, generator=torch.Generator())
        batch[ROUTED_EXPERTS_KEY] = scores.argsort(-1)[..., :TOP_K].to(torch.int16)
    with count_syncs() as sites:
        engine.forward_backward_batch(batch)
    # Control: the optimizer step's one sync (the grad norm) must be seen, else the probe is blind.
    with count_syncs() as control:
        engine.optimizer_step()
    assert control, "the probe missed the optimizer step's grad-norm sync"
    assert any(site.startswith("validation.py") for site in sites), "tolist probe blind"
    return sites


@pytest.mark.parametrize(
    "engine_cls, config_cls, packed",
    [
        (ActorEngine, ActorConfig, False),
        (ActorEngine, ActorConfig, True),
        (CriticEngine, CriticConfig, True),
    ],
    ids=["actor-padded", "actor-packed", "critic-packed"],
)
def test_engine_syncs_do_not_grow_with_micro_batches(engine_cls, config_cls, packed) -> None:
    one = _count(engine_cls, config_cls(micro_batch_size=6, pack_sequences=packed))
    six = _count(engine_cls, config_cls(micro_batch_size=1, pack_sequences=packed))
    assert six == one, f"syncs per micro-batch from engine code: {dict(six - one)}"


@pytest.mark.parametrize("moe", ["replay", "counting-pass"])
def test_moe_routing_adds_no_sync_per_micro_batch(moe) -> None:
    """A mixture of experts with both router losses: replay and the agreement metric, or the
    counting pass that finds the load fractions, add no sync per micro-batch either."""
    losses = RouterLossConfig(aux_loss_coef=0.01, z_loss_coef=0.001)
    one = _count(ActorEngine, ActorConfig(micro_batch_size=6, router_loss=losses), moe)
    six = _count(ActorEngine, ActorConfig(micro_batch_size=1, router_loss=losses), moe)
    assert six == one, f"syncs per micro-batch from engine code: {dict(six - one)}"
