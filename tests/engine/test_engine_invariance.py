"""Gradient, loss and metrics do not depend on how a mini-batch is split (docs/losses.md).

The model runs in float64, so any difference beyond reassociation noise (~1e-12) is a bug in the
normalisation (a local denominator, a dropped or double-counted micro-batch, a wrong row order).
Every test runs with 1 and with 2 intra-op threads (the ``intra_op_threads`` fixture): with 2,
BLAS splits GEMMs differently per row count, which is exactly the noise the tolerances allow for.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_close_dicts, grads_of, make_batch, tiny_model

from microrl.configs import ActorConfig, CriticConfig, PolicyLossConfig
from microrl.engine import ActorEngine, CriticEngine
from microrl.losses.aggregation import AggMode

pytestmark = pytest.mark.usefixtures("intra_op_threads")

GRAD_RTOL, GRAD_ATOL = 1e-9, 1e-12  # fp64 gradients: reassociation noise only
# Metrics (and the reported loss) are float32 by the metrics contract (losses/metrics.py), so the
# sums over micro-batches differ from the single-micro-batch value by fp32 rounding at most.
RTOL, ATOL = 2e-6, 1e-7
B = 6
# (micro_batch_size, max_tokens, packed) against one micro-batch of all B rows: fixed sizes 1 and
# 2; strict budgets below the longest row (each row alone) and in between; packed rows.
SPLITS = [
    (1, None, False),
    (2, None, False),
    (None, 5, False),
    (None, 17, False),
    (2, None, True),
    (None, 13, True),
]


def _run(engine_cls, config, state, batch):
    model = tiny_model("qwen2", dtype=torch.float64)
    model.load_state_dict(state)
    engine = engine_cls(model, config)
    result = engine.forward_backward_batch(batch)
    return result, grads_of(engine.module)


def _compare_splits(engine_cls, make_config, batch) -> None:
    state = tiny_model("qwen2", dtype=torch.float64).state_dict()
    reference, ref_grads = _run(engine_cls, make_config(B, None, False), state, batch)
    assert any(g.abs().sum() > 0 for g in ref_grads.values())
    for mbs, budget, packed in SPLITS:
        result, grads = _run(engine_cls, make_config(mbs, budget, packed), state, batch)
        split = f"micro_batch_size={mbs} max_tokens={budget} packed={packed}"
        assert abs(result["loss"] - reference["loss"]) <= ATOL + RTOL * abs(reference["loss"]), (
            split
        )
        assert_close_dicts(result["metrics"], reference["metrics"], rtol=RTOL, atol=ATOL)
        assert_close_dicts(grads, ref_grads, rtol=GRAD_RTOL, atol=GRAD_ATOL)
        for key in list(reference["model_output"].keys()):
            torch.testing.assert_close(
                result["model_output"][key], reference["model_output"][key], rtol=0, atol=1e-6
            )


@pytest.mark.parametrize("mode", list(AggMode), ids=[m.value for m in AggMode])
def test_actor_split_invariance(mode: AggMode) -> None:
    batch = make_batch(B, 10, padding="mixed", seed=11, dtype=torch.float64)
    batch["ref_logprobs"] = batch["old_logprobs"] + 0.1 * torch.randn(
        batch["old_logprobs"].shape, dtype=torch.float64
    )

    def make_config(mbs, budget, packed):
        return ActorConfig(
            micro_batch_size=mbs,
            max_tokens_per_micro_batch=budget,
            pack_sequences=packed,
            loss_agg_mode=mode,
            seq_len_norm=8.0 if mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM else None,
            policy_loss=PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01),
            temperature=0.9,
        )

    _compare_splits(ActorEngine, make_config, batch)


@pytest.mark.parametrize("name", ["gspo", "cispo", "reinforce"])
def test_actor_split_invariance_other_surrogates(name: str) -> None:
    batch = make_batch(B, 10, padding="mixed", seed=12, dtype=torch.float64)

    def make_config(mbs, budget, packed):
        return ActorConfig(
            micro_batch_size=mbs,
            max_tokens_per_micro_batch=budget,
            pack_sequences=packed,
            loss_agg_mode="seq-mean-token-mean",
            policy_loss=PolicyLossConfig(name=name),
        )

    _compare_splits(ActorEngine, make_config, batch)


@pytest.mark.parametrize("mode", list(AggMode), ids=[m.value for m in AggMode])
def test_critic_split_invariance(mode: AggMode) -> None:
    batch = make_batch(B, 10, padding="mixed", seed=13, dtype=torch.float64)

    def make_config(mbs, budget, packed):
        return CriticConfig(
            micro_batch_size=mbs,
            max_tokens_per_micro_batch=budget,
            pack_sequences=packed,
            loss_agg_mode=mode,
            seq_len_norm=8.0 if mode is AggMode.SEQ_MEAN_TOKEN_SUM_NORM else None,
            cliprange_value=0.5,
        )

    _compare_splits(CriticEngine, make_config, batch)


def test_row_order_of_outputs_is_the_callers() -> None:
    """Shuffling the rows of the batch shuffles the outputs the same way."""
    engine = ActorEngine(
        tiny_model(), ActorConfig(micro_batch_size=None, max_tokens_per_micro_batch=20)
    )
    batch = make_batch(B, 10, seed=14)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    out = engine.infer_batch(batch)
    shuffled = engine.infer_batch(batch[perm])
    # fp32 model, rows in other micro-batches: GEMM rounding only (~5e-7 measured, 2 threads).
    torch.testing.assert_close(shuffled["logprobs"], out["logprobs"][perm], atol=1e-5, rtol=0)


class PaddedCountActor(ActorEngine):
    """As if another data-parallel rank needed more micro-batches: empty ones are appended."""

    def _agree_num_micro_batches(self, n: int) -> int:
        return n + 3


def test_extra_empty_micro_batches_change_nothing() -> None:
    batch = make_batch(B, 10, padding="mixed", seed=15, dtype=torch.float64)
    state = tiny_model("qwen2", dtype=torch.float64).state_dict()
    results = []
    for cls in (ActorEngine, PaddedCountActor):
        model = tiny_model("qwen2", dtype=torch.float64)
        model.load_state_dict(state)
        engine = cls(model, ActorConfig(micro_batch_size=2))
        results.append((engine.forward_backward_batch(batch), grads_of(engine.module)))
    (plain, g_plain), (padded, g_padded) = results
    assert padded["loss"] == pytest.approx(plain["loss"], rel=RTOL, abs=ATOL)
    assert_close_dicts(padded["metrics"], plain["metrics"], rtol=RTOL, atol=ATOL)
    assert_close_dicts(g_padded, g_plain, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    torch.testing.assert_close(
        padded["model_output"]["logprobs"], plain["model_output"]["logprobs"], rtol=0, atol=1e-6
    )


def test_forward_step_with_global_denominators_sums_to_the_batch_loss() -> None:
    """forward_step is the loop's building block: its partial losses add up to the batch loss."""
    from microrl.losses import global_denominators

    engine = ActorEngine(tiny_model(dtype=torch.float64), ActorConfig(micro_batch_size=B))
    batch = make_batch(B, 10, seed=16, dtype=torch.float64)
    denominators = global_denominators(batch["loss_mask"])
    total = sum(
        engine.forward_step(batch[i : i + 2], denominators=denominators)[0].item()
        for i in range(0, B, 2)
    )
    assert total == pytest.approx(engine.forward_backward_batch(batch)["loss"], rel=RTOL)
    loss, output, _ = engine.forward_step(batch)  # alone: the micro-batch is the mini-batch
    assert loss.grad_fn is not None and output["logprobs"].grad_fn is None
    assert loss.item() == pytest.approx(total, rel=RTOL)
