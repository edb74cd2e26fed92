"""Random-number-generator states as JSON-able values (python, numpy, torch CPU, CUDA).

Exact resume needs them: dropout masks and sampling draw from these streams. Stored as plain
lists (no pickle), one file per rank.
"""

from __future__ import annotations

import random
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states; numpy's only when the program already imported numpy."""
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(mt), gauss]}
    if "numpy" in sys.modules:  # never import numpy just for this
        np_state = sys.modules["numpy"].random.get_state()
        state["numpy"] = [np_state[0], np_state[1].tolist(), *np_state[2:]]
    state["torch"] = torch.get_rng_state().tolist()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        state["cuda_device"] = torch.cuda.current_device()  # the GPU this process drew from
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, *rest = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        _set_cuda_states([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]], state)


def _set_cuda_states(states: list[torch.Tensor], state: Mapping[str, Any]) -> None:
    """One state per GPU visible at the save, each to its GPU; if the visible GPUs changed, the
    state of the GPU the save drew from goes to the current GPU, with a warning (never an
    ``IndexError``)."""
    visible = torch.cuda.device_count()
    if len(states) == visible:
        torch.cuda.set_rng_state_all(states)
        return
    saved_device = state.get("cuda_device")
    current = torch.cuda.current_device()
    if saved_device is not None and 0 <= saved_device < len(states):
        torch.cuda.set_rng_state(states[saved_device], current)
        what = f"GPU {saved_device}'s state (the one the saving process used) to GPU {current}"
    else:
        for index in range(min(len(states), visible)):
            torch.cuda.set_rng_state(states[index], index)
        what = f"the states of GPUs 0-{min(len(states), visible) - 1}"
    warnings.warn(
        f"the checkpoint holds the CUDA RNG states of {len(states)} GPUs and {visible} are "
        f"visible now: restored {what} only (CUDA_VISIBLE_DEVICES differs from the saving run)",
        stacklevel=3,
    )
