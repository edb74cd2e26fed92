"""The loss of the fused loss path, one group of whole sequences at a time (docs/engine.md).

On the fused loss path the loss runs inside the lm head: :func:`microrl.kernels.fused_linear_loss`
calls a :class:`GroupLoss` with the predicting-position log-probs (and entropy) of a group of
whole rows, and forms the head's gradients right there, so the ``[N, V]`` logits never exist.
The engine builds a :class:`GroupLoss` per micro-batch and passes it to the role's
``_model_forward`` as an argument. It aligns the group's outputs to tokens exactly as the loop
does (:func:`~microrl.engine.outputs.align_outputs`) and calls the engine's loss on those rows
with the mini-batch's denominators. Every built-in loss is a sum over rows, so the group losses
add up to the micro-batch's loss, and their metrics combine to its metrics (:meth:`metrics`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict

from microrl.engine import packing
from microrl.engine.alignment import next_token_targets
from microrl.engine.outputs import align_outputs
from microrl.losses.metrics import Metric, Reduce

__all__ = ["GroupLoss"]

# (output, rows of the micro-batch) -> (partial loss, metrics), the result already checked.
RowsLoss = Callable[[TensorDict, TensorDict], tuple[torch.Tensor, dict[str, Metric]]]


class GroupLoss:
    """The engine's loss on the row groups of one compact micro-batch.

    Args:
        micro: the compact right-padded micro-batch ``[b, L]``.
        lengths: its rows' real-token counts, on the host.
        loss: ``loss(output, rows) -> (partial loss, metrics)`` on a slice of ``micro``.
        packed: whether the head sees the rows packed into ``[1, N]``.

    :attr:`segments` are the row boundaries in the flattened head rows (what the kernel's groups
    never split). The head returns the micro-batch's loss; :meth:`metrics` are its metrics.
    """

    def __init__(
        self, micro: TensorDict, lengths: list[int], loss: RowsLoss, *, packed: bool
    ) -> None:
        self.micro, self.loss_of_rows, self.packed = micro, loss, packed
        self.valid = micro["attention_mask"]
        _, self.has_next = next_token_targets(micro["input_ids"], self.valid)
        width = self.valid.shape[1]
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + (length if packed else width))
        self.segments = bounds
        self._row_of = {bound: r for r, bound in enumerate(bounds)}
        self._metrics: list[dict[str, Metric]] = []

    def __call__(
        self, start: int, end: int, logprobs: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None]:
        """The kernel's callback for flat head rows ``[start, end)``: the rows' partial loss."""
        r0, r1 = self._row_of[start], self._row_of[end]
        valid, has_next = self.valid[r0:r1], self.has_next[r0:r1]
        raw = (
            {"logprobs": logprobs}
            if entropy is None
            else {"logprobs": logprobs, "entropy": entropy}
        )
        if self.packed:
            index = packing.packed_index(valid, end - start)
            shape = (1, end - start)
            unpack = lambda v: packing.unpack(v, index, valid)  # noqa: E731
        else:
            shape, unpack = (r1 - r0, valid.shape[1]), None
        raw = {key: value.view(shape) for key, value in raw.items()}
        aligned = align_outputs(raw, r1 - r0, shape, has_next, unpack, "ActorEngine")
        output = TensorDict(aligned, batch_size=[r1 - r0], device=logprobs.device)
        loss, metrics = self.loss_of_rows(output, self.micro[r0:r1])
        self._metrics.append(metrics)
        return loss, None

    def metrics(self) -> dict[str, Metric]:
        """The micro-batch's metrics from its groups': ``SUM`` partials add up, ``MIN``/``MAX``
        take the extreme (on device, no sync)."""
        if len(self._metrics) == 1:
            return self._metrics[0]
        out = {}
        for name, first in self._metrics[0].items():
            values = torch.stack([group[name].value.reshape(()) for group in self._metrics])
            if first.reduce is Reduce.SUM:
                value = values.sum()
            else:
                value = values.min() if first.reduce is Reduce.MIN else values.max()
            out[name] = Metric(value, first.reduce)
        return out
