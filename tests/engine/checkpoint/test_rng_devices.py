"""CUDA RNG states resume on another set of visible GPUs (engine/checkpoint/rng.py).

A checkpoint holds one CUDA RNG state per GPU visible when it was saved. Resumed where fewer are
visible (``CUDA_VISIBLE_DEVICES`` narrowed to each rank's own GPU, a smaller machine),
``torch.cuda.set_rng_state_all`` raised ``IndexError`` for the first GPU that is not there. Now
the state of the GPU the saving process drew from goes to the current GPU, with a warning.
CUDA is monkeypatched: torch's own ``set_rng_state`` runs, on stand-in generators.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from microrl.engine.checkpoint.rng import rng_state, set_rng_state


class Generator:
    def __init__(self, index: int) -> None:
        self.index, self.state = index, None

    def set_state(self, state: torch.Tensor) -> None:
        self.state = state.tolist()


def _cuda(monkeypatch, visible: int, current: int = 0) -> list[Generator]:
    generators = [Generator(i) for i in range(visible)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "default_generators", tuple(generators))
    monkeypatch.setattr(
        torch.cuda,
        "get_rng_state_all",
        lambda: [torch.full((4,), 10 + i, dtype=torch.uint8) for i in range(visible)],
    )
    return generators


def _saved(monkeypatch, visible: int, current: int) -> dict:
    """What a process on GPU ``current`` of ``visible`` saves."""
    with monkeypatch.context() as m:
        _cuda(m, visible, current)
        return rng_state()


def test_fewer_visible_gpus_restore_the_saving_processs_gpu_into_the_current_one(monkeypatch):
    state = _saved(monkeypatch, visible=2, current=1)  # rank 1 of a node that saw 2 GPUs
    (gpu,) = _cuda(monkeypatch, visible=1)  # resumed with CUDA_VISIBLE_DEVICES=<its GPU>
    with pytest.warns(UserWarning, match=r"states of 2 GPUs and 1 are visible.*GPU 1's state"):
        set_rng_state(state)  # was: IndexError (torch.cuda.default_generators[1])
    assert gpu.state == [11] * 4
    assert state["cuda_device"] == 1 and len(state["cuda"]) == 2


def test_a_checkpoint_without_the_device_restores_the_gpus_both_runs_see(monkeypatch):
    state = _saved(monkeypatch, visible=3, current=0)
    state.pop("cuda_device", None)  # written before it was recorded
    generators = _cuda(monkeypatch, visible=2)
    with pytest.warns(UserWarning, match="restored the states of GPUs 0-1 only"):
        set_rng_state(state)
    assert [g.state for g in generators] == [[10] * 4, [11] * 4]


def test_the_same_gpus_restore_every_state_silently(monkeypatch):
    state = _saved(monkeypatch, visible=2, current=0)
    generators = _cuda(monkeypatch, visible=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_rng_state(state)
    assert [g.state for g in generators] == [[10] * 4, [11] * 4]
