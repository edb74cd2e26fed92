"""A trained model's full tensors, gathered one at a time so a push never holds the whole model;
``metadata()`` needs no gather (vLLM's ``WeightSource`` protocol, docs/async.md#vllm-servers)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["FullWeights"]


class FullWeights:
    """``(name, full tensor)`` pairs of the causal LM at ``prefix`` in ``module``, per pass.

    Args:
        module: the engine's module (FSDP2-sharded or not).
        prefix: the causal LM's path in ``module``; names are given without it.
        trainable_only: only the tensors that train, else every one (tied ones under each name).
        device: where each full tensor is handed over; None: where it was gathered.
        dtype: the dtype each is handed over in (the sampler's); None: its own.

    Iterating a sharded model is collective; pair ``i`` is valid until pair ``i + 1`` is requested.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        prefix: str = "",
        *,
        trainable_only: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.module, self.prefix = module, prefix
        self.trainable_only = trainable_only
        self.device = None if device is None else torch.device(device)
        self.dtype = dtype

    def _sharded(self) -> dict[str, torch.Tensor]:
        """The state dict as the ranks hold it (DTensor shards: nothing gathered)."""
        options = StateDictOptions(
            full_state_dict=False, cpu_offload=False, ignore_frozen_params=self.trainable_only
        )
        state = get_model_state_dict(self.module, options=options)
        n = len(self.prefix)
        return {k[n:]: v for k, v in state.items() if k.startswith(self.prefix)}

    def metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of every pair iteration yields, in order; no gather."""
        state = self._sharded().items()
        return [(name, self.dtype or v.dtype, tuple(v.shape)) for name, v in state]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in self._sharded().items():
            full = materialize(value).to(device=self.device, dtype=self.dtype)  # None: unchanged
            yield name, full
            del full  # before the next gather: one full tensor at a time


def materialize(value: torch.Tensor) -> torch.Tensor:
    """``value`` detached, a ``DTensor`` all-gathered on its mesh's device type."""
    if isinstance(value, DTensor):
        if value.device.type != value.device_mesh.device_type:
            value = value.to(value.device_mesh.device_type)
        value = value.full_tensor()
    return value.detach()
