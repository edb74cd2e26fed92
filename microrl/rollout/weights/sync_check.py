"""Every weight push is verified: a sampler scores a fixed probe batch, the trainer compares,
within a tolerance set by the precision (docs/async.md#every-push-is-checked)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tensordict import TensorDict

from microrl.engine import setup
from microrl.engine.checkpoint.export import locate_base_model
from microrl.rollout.layout import Samples, build_rollout
from microrl.rollout.samplers.hf import engine_autocast_dtype

__all__ = [
    "FP32_SYNC_CHECK_TOL",
    "LOW_PRECISION_SYNC_CHECK_TOL",
    "SYNC_CHECK_STAT",
    "SyncCheckError",
    "build_probe",
    "default_sync_check_tol",
    "engine_probe",
    "engine_probe_logprobs",
    "probe_rows",
    "probe_stats",
    "rows_to_probe_layout",
]

#: The probe statistic ``sync_check_tol`` bounds: the mean |trainer - sampler| log-prob. Not the
#: max (a few tokens' bf16 rounding, 2x apart from probe to probe), nor k3 (one token dominates).
SYNC_CHECK_STAT = "sync/probe_abs_diff_mean"
#: Default ``sync_check_tol`` of a float32 engine: 10x fp32 rounding, below a push a step stale.
FP32_SYNC_CHECK_TOL = 5e-5
#: Default ``sync_check_tol`` of a 16-bit engine: bf16 rounding with a 2x margin; it fails a push
#: that did not land, not one a step stale (only the ``hf`` worker's checksums see that).
LOW_PRECISION_SYNC_CHECK_TOL = 0.25
_PROBE_ROWS, _PROBE_LEN = 4, 16
# The vision token ids of a vision-language model's config, left out of the probe.
_VISION_TOKEN_IDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


class SyncCheckError(RuntimeError):
    """A weight push whose probe log-probs or tensor checksums differ from the trainer's."""


def build_probe(
    vocab_size: int, max_positions: int, tokenizer, *, seed: int = 0, exclude: Iterable[int] = ()
) -> TensorDict:
    """The fixed probe batch: a few rows of random tokens (no ``<eos>``, padding or ``exclude``
    ids), in the rollout layout."""
    gen = torch.Generator().manual_seed(seed)
    specials = {tokenizer.eos_token_id, tokenizer.pad_token_id, *exclude}
    allowed = torch.tensor([t for t in range(vocab_size) if t not in specials])
    length = max(_PROBE_ROWS + 2, min(_PROBE_LEN, max_positions))
    prompts, responses = [], []
    for row in range(_PROBE_ROWS):  # prompts of 1, 2, ... tokens: left padding of every width
        draw = allowed[torch.randint(len(allowed), (length,), generator=gen)].tolist()
        prompts.append(draw[: row + 1])
        responses.append(draw[row + 1 : row + 1 + length - _PROBE_ROWS])
    samples = Samples(token_ids=responses, logprobs=[[0.0] * len(r) for r in responses])
    batch = build_rollout(
        prompts,
        samples,
        num_samples=1,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return batch.select("input_ids", "attention_mask", "loss_mask")


def engine_probe(engine, tokenizer) -> TensorDict:
    """:func:`build_probe` for ``engine``'s vocabulary and its model's positions."""
    base = locate_base_model(engine.module)[1]
    max_positions = getattr(base.config, "max_position_embeddings", _PROBE_LEN)
    # A vision-language model's image placeholders need pixels: a text probe has none.
    vision = [getattr(base.config, name, None) for name in _VISION_TOKEN_IDS]
    exclude = [t for t in vision if t is not None]
    return build_probe(engine.vocab_size, max_positions, tokenizer, exclude=exclude)


def engine_probe_logprobs(engine, probe: TensorDict) -> torch.Tensor:
    """The engine's log-probs of ``probe`` at temperature 1, ``[B, T]`` float32 on the CPU."""
    batch = probe.clone()
    batch["temperature"] = torch.ones(batch.batch_size[0], dtype=torch.float32)
    return engine.infer_batch(batch)["logprobs"].float().cpu()


def probe_rows(probe: TensorDict) -> list[list[int]]:
    """The probe's rows without their padding: what a sampler scores."""
    ids, mask = probe["input_ids"], probe["attention_mask"].bool()
    return [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]


def rows_to_probe_layout(probe: TensorDict, row_logprobs: list[list[float]]) -> torch.Tensor:
    """A sampler's log-probs of each row's tokens after its first, in the probe's ``[B, T]``
    layout (0 off ``loss_mask``), as the engine returns them."""
    mask = probe["attention_mask"].bool().cpu()
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for b, values in enumerate(row_logprobs):
        out[b, mask[b].nonzero().squeeze(1)[1:]] = torch.tensor(values, dtype=torch.float32)
    return torch.where(probe["loss_mask"].cpu(), out, 0.0)


def probe_stats(expected: torch.Tensor, actual: torch.Tensor, mask: torch.Tensor) -> dict:
    """Statistics of ``d = expected - actual`` (``[B, T]``) over ``mask``, in float64: the mean
    k3 ``exp(d) - 1 - d``, the max and the mean (:data:`SYNC_CHECK_STAT`) of ``|d|``."""
    delta = (expected.double() - actual.double())[mask]
    return {
        "sync/probe_kl": float((torch.expm1(delta) - delta).mean()),
        "sync/probe_abs_diff_max": float(delta.abs().max()),
        SYNC_CHECK_STAT: float(delta.abs().mean()),
    }


def default_sync_check_tol(engine) -> float:
    """The default ``sync_check_tol`` of ``engine``'s precision."""
    autocast = engine_autocast_dtype(engine) is not None
    full_precision = setup.base_dtype(engine.config).itemsize >= 4 and not autocast
    return FP32_SYNC_CHECK_TOL if full_precision else LOW_PRECISION_SYNC_CHECK_TOL
