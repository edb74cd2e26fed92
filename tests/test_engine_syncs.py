"""No host sync inside the micro-batch loop from the engine's own code (design.md section 6).

A host sync shows up at the dispatcher as ``_local_scalar_dense`` (``.item()``, ``bool()``,
``.tolist()``), ``nonzero`` / ``masked_select``, or an index with a boolean mask. Each one is
attributed to the innermost non-torch Python frame that issued it; those issued by
``microrl/engine`` must not grow with the number of micro-batches (the kernel's own input checks
and transformers' mask construction are theirs, not the loop's).
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from engine_utils import make_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import microrl.engine.base
from microrl.configs import ActorConfig, CriticConfig
from microrl.engine import ActorEngine, CriticEngine

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select"}
_BOOL_INDEX_OPS = {"index", "index_put", "index_put_"}
_TORCH_DIR = str(Path(torch.__file__).parent)
_ENGINE_DIR = str(Path(microrl.engine.base.__file__).parent)


def _is_sync(func, args) -> bool:
    name = func.overloadpacket.__name__
    if name in _SYNC_OPS:
        return True
    if name in _BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class _EngineSyncs(TorchDispatchMode):
    """Counts sync ops whose innermost non-torch caller is a file of ``microrl/engine``."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_sync(func, args):
            frames = [
                f
                for f in traceback.extract_stack()
                if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__
            ]
            if frames and frames[-1].filename.startswith(_ENGINE_DIR):
                self.sites[f"{Path(frames[-1].filename).name}:{frames[-1].lineno}"] += 1
        return func(*args, **(kwargs or {}))


def _count(engine_cls, config) -> collections.Counter[str]:
    engine = engine_cls(tiny_model(), config)
    batch = make_batch(6, 10, seed=40)
    with _EngineSyncs() as mode:
        engine.forward_backward_batch(batch)
    # Control: the optimizer step's one sync (the grad norm) must be seen, else the probe is blind.
    with _EngineSyncs() as control:
        engine.optimizer_step()
    assert control.sites, "the probe missed the optimizer step's grad-norm sync"
    return mode.sites


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
