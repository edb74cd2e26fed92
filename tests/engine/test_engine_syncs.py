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
import traceback
from pathlib import Path

import pytest
import torch
from engine_utils import make_batch, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import microrl.engine.base
import microrl.kernels
from microrl.configs import ActorConfig, CriticConfig
from microrl.engine import ActorEngine, CriticEngine

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select"}
_BOOL_INDEX_OPS = {"index", "index_put", "index_put_"}
_TORCH_DIR = str(Path(torch.__file__).parent)
_ENGINE_DIR = str(Path(microrl.engine.base.__file__).parent)
_KERNELS_DIR = str(Path(microrl.kernels.__file__).parent)


def _is_sync(func, args) -> bool:
    name = func.overloadpacket.__name__
    if name in _SYNC_OPS:
        return True
    if name in _BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class _EngineSyncs(TorchDispatchMode):
    """Counts syncs whose innermost non-torch caller is a file of ``microrl/engine`` or
    ``microrl/kernels`` (``Tensor.tolist`` through the wrapper :func:`_count` installs)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def record(self) -> None:
        frames = [
            f
            for f in traceback.extract_stack()
            if not f.filename.startswith(_TORCH_DIR) and f.filename != __file__
        ]
        if frames and frames[-1].filename.startswith((_ENGINE_DIR, _KERNELS_DIR)):
            self.sites[f"{Path(frames[-1].filename).name}:{frames[-1].lineno}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _is_sync(func, args):
            self.record()
        return func(*args, **(kwargs or {}))


def _count(engine_cls, config, monkeypatch) -> collections.Counter[str]:
    engine = engine_cls(tiny_model(), config)
    batch = make_batch(6, 10, seed=40)
    active: list[_EngineSyncs] = []
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        if active:
            active[-1].record()
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with _EngineSyncs() as mode:
        active.append(mode)
        engine.forward_backward_batch(batch)
    # Control: the optimizer step's one sync (the grad norm) must be seen, else the probe is blind.
    with _EngineSyncs() as control:
        active.append(control)
        engine.optimizer_step()
    active.clear()
    assert control.sites, "the probe missed the optimizer step's grad-norm sync"
    assert any(site.startswith("validation.py") for site in mode.sites), "tolist probe blind"
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
def test_engine_syncs_do_not_grow_with_micro_batches(
    engine_cls, config_cls, packed, monkeypatch
) -> None:
    one = _count(engine_cls, config_cls(micro_batch_size=6, pack_sequences=packed), monkeypatch)
    six = _count(engine_cls, config_cls(micro_batch_size=1, pack_sequences=packed), monkeypatch)
    assert six == one, f"syncs per micro-batch from engine code: {dict(six - one)}"
