"""A trained model's full tensors, gathered one at a time (docs/async.md#vllm-servers).

:class:`FullWeights` is what a weight push reads: the causal LM's tensors by their checkpoint
names, each FSDP2/tensor-parallel ``DTensor`` all-gathered (``full_tensor()``, on every rank)
only when iteration reaches it and dropped by the time the next one is gathered, so a push
never holds the whole model on a GPU (nor on the CPU). Its ``metadata()`` (names, dtypes,
global shapes) needs no gather: vLLM's weight-transfer engines size their receive buffers from
it (it follows vLLM's ``WeightSource`` protocol). :func:`gather_full_weights` is the eager form
(CPU copies of every tensor), for the ``hf`` worker's flat buffers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["FullWeights", "gather_full_weights"]


class FullWeights:
    """``(name, full tensor)`` pairs of the causal LM at ``prefix`` in ``module``
    (:func:`~microrl.engine.checkpoint.export.locate_base_model`), re-read on every pass.

    Args:
        module: the engine's module (FSDP2-sharded or not).
        prefix: the causal LM's path in ``module``; names are given without it.
        trainable_only: only the tensors that train (an adapter's), else every tensor,
            tied ones under each of their names as a checkpoint holds them.
        device: where each full tensor is handed over (``"cpu"``: a CPU copy, what gloo
            sends); None: where it was gathered (the trainer's GPU under NCCL).
        dtype: the dtype each is handed over in (the sampler's: a bf16 vLLM takes half the
            bytes of the trainer's fp32 master weights); None: its own.

    Iterating is collective under ``torchrun`` when the model is sharded: every rank must
    iterate the same passes in the same order. Pair ``i`` is valid until pair ``i + 1`` is
    requested (the generator drops its reference then).
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
        """The state dict as the ranks hold it (shards as DTensors: nothing gathered or copied)."""
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
            full = materialize(value)
            if self.device is not None or self.dtype is not None:
                full = full.to(device=self.device, dtype=self.dtype)
            yield name, full
            del full  # before the next gather: one full tensor at a time


def materialize(value: torch.Tensor) -> torch.Tensor:
    """The full, local tensor of ``value``: a ``DTensor`` all-gathered on its mesh's device
    type (a CPU-offloaded shard moved there first, as torch's own full state dict does), any
    other tensor as it is (detached)."""
    if isinstance(value, DTensor):
        if value.device.type != value.device_mesh.device_type:
            value = value.to(value.device_mesh.device_type)
        value = value.full_tensor()
    return value.detach()


def gather_full_weights(
    module: torch.nn.Module, prefix: str, *, trainable_only: bool
) -> dict[str, torch.Tensor]:
    """Every pair of :class:`FullWeights` as a dict of CPU tensors (gathered one at a time, so
    a GPU never holds more than one full tensor). Collective under ``torchrun``."""
    return dict(FullWeights(module, prefix, trainable_only=trainable_only, device="cpu"))
