"""The loss of the fused loss path, one group of whole sequences at a time (docs/engine.md).

:func:`microrl.kernels.fused_linear_loss` calls a :class:`GroupLoss` with the log-probs (and
entropy) of a group of whole rows inside the lm head, and gets the engine's loss on them; the
built-in losses are sums over rows, so the group losses add up to the micro-batch's loss.
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
    """The engine's loss on the row groups of one compact right-padded ``[b, L]`` micro-batch.

    ``lengths``: its rows' real-token counts (host); ``loss(output, rows) -> (partial loss,
    metrics)`` on a slice of ``micro``; ``packed``: the head sees the rows as ``[1, N]``.
    :attr:`segments`: the row boundaries in the flat head rows (the kernel never splits a row).
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
        if self.packed:
            index = packing.packed_index(valid, end - start)
            shape = (1, end - start)
            unpack = lambda v: packing.unpack(v, index, valid)  # noqa: E731
        else:
            shape, unpack = (r1 - r0, valid.shape[1]), None
        raw = {"logprobs": logprobs, "entropy": entropy}
        raw = {key: value.view(shape) for key, value in raw.items() if value is not None}
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
