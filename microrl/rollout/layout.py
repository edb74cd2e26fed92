"""Rows ``[left-padded prompt | response, right-padded]`` in the engine's token-aligned
``[B, T]`` layout, ``loss_mask`` on the response (docs/batch.md)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from microrl.engine.moe.routes import NO_ROUTE, ROUTED_EXPERTS_KEY

__all__ = ["Samples", "build_rollout", "first_stop", "routes_of_rows"]


@dataclass
class Samples:
    """What a backend returns per row (grouped by prompt): the sampled ids and their log-probs.

    ``routed_experts`` (``rollout.routing_replay``): every fed token's experts
    ``[B, W + S, L, k]``, prompts left-padded to ``W``, then ``S`` generated steps.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    routed_experts: torch.Tensor | None = None


def first_stop(ids: Sequence[int], stops: Collection[int]) -> int:
    """How many of ``ids`` a turn keeps: up to and including its first id in ``stops``, else all."""
    return next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))


def build_rollout(
    prompt_ids: Sequence[Sequence[int]],
    samples: Samples,
    *,
    num_samples: int,
    eos_token_id: int | Collection[int],
    pad_token_id: int,
) -> TensorDict:
    """Lay out prompts and sampled responses as the engine's ``[B, T]`` batch (see :class:`Rollout`).

    Row ``i`` of ``samples`` answers prompt ``i // num_samples``. A response is cut after its
    first ``eos_token_id`` (one id or several); one without any is ``truncated`` ``[B]``.
    """
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    rows = len(samples.token_ids)
    if rows != len(prompt_ids) * num_samples or len(samples.logprobs) != rows:
        raise ValueError(
            f"a backend returned {rows} responses and {len(samples.logprobs)} log-prob lists for "
            f"{len(prompt_ids)} prompts x num_samples={num_samples}"
        )
    responses, logprobs, truncated = [], [], []
    for ids, lps in zip(samples.token_ids, samples.logprobs, strict=True):
        if len(ids) != len(lps):
            raise ValueError(f"a response has {len(ids)} tokens but {len(lps)} log-probs")
        end = first_stop(ids, stops)
        responses.append(list(ids[:end]))
        logprobs.append(list(lps[:end]))
        truncated.append(not (end and ids[end - 1] in stops))
    prompts = [prompt_ids[i // num_samples] for i in range(rows)]
    batch = rollout_batch(prompts, responses, logprobs, truncated, pad_token_id)
    if samples.routed_experts is not None:
        batch[ROUTED_EXPERTS_KEY] = routes_of_rows(samples.routed_experts, batch["attention_mask"])
    return batch


def rollout_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    truncated: Sequence[bool],
    pad_token_id: int,
    sampled: Sequence[Sequence[bool]] | None = None,
) -> TensorDict:
    """Row ``i`` ``[left-padded prompts[i] | responses[i], right-padded]`` as the ``[B, T]``
    batch; ``loss_mask`` on ``sampled[i]`` (None: the whole response), ``truncated`` ``[B]``.
    Built from padded lists: a per-row loop of tensor copies cost ~20 ms for 1024 rows."""
    prompt_width = max(len(p) for p in prompts)
    response_width = max(1, max(len(r) for r in responses))
    pad, zeros = [pad_token_id] * response_width, [0.0] * response_width
    input_ids = [
        [pad_token_id] * (prompt_width - len(p)) + [*p, *r] + pad[len(r) :]
        for p, r in zip(prompts, responses, strict=True)
    ]
    rollout_logprobs = [[0.0] * prompt_width + [*lp] + zeros[len(lp) :] for lp in logprobs]
    cols = torch.arange(prompt_width + response_width)
    starts = prompt_width - torch.tensor([len(p) for p in prompts])
    ends = prompt_width + torch.tensor([len(r) for r in responses])
    attention = (cols >= starts[:, None]) & (cols < ends[:, None])
    if sampled is None:
        loss_mask = (cols >= prompt_width) & (cols < ends[:, None])
    else:
        no = [False] * response_width
        loss_mask = torch.tensor([[False] * prompt_width + [*m] + no[len(m) :] for m in sampled])
    columns = {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rollout_logprobs": torch.tensor(rollout_logprobs, dtype=torch.float32),
        "truncated": torch.tensor(truncated, dtype=torch.bool),
    }
    return TensorDict(columns, batch_size=[len(prompts)])


def routes_of_rows(routes: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """A backend's recorded routing ``[B, W + S, L, k]`` in the rows' layout ``[B, T]``
    (``attention`` ``[B, T]``), :data:`NO_ROUTE` off the rows' real tokens."""
    rows, width = attention.shape
    if routes.dim() != 4 or routes.shape[0] != rows:
        raise ValueError(
            f"a backend recorded {ROUTED_EXPERTS_KEY!r} of shape {tuple(routes.shape)} for "
            f"{rows} rows: expected [B, W + S, L, k]"
        )
    out = routes.new_full((rows, width, *routes.shape[2:]), NO_ROUTE)
    span = min(width, routes.shape[1])
    out[:, :span] = routes[:, :span]
    return torch.where(attention.bool()[:, :, None, None], out, NO_ROUTE)
