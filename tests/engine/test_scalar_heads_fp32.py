"""The critic's value head and the reward model's score head compute in float32 under bf16
autocast, as the lm head does (engine/models.py ``fp32_linear``).

Each engine runs with ``dtype="bfloat16"`` (autocast on the CPU too); the body's final hidden
states are captured, and the head's output must equal ``hidden @ W.T (+ b)`` in float64 on those
very states to float32 rounding, and differ from the same head computed in bf16 by far more than
that tolerance (so the test sees a head that autocast rounds to 16 bits).
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_batch, tiny_model

from microrl.configs import CriticConfig, EngineConfig
from microrl.engine import CriticEngine, RewardModelEngine

# fp32 head on fp32-upcast bf16 hidden states (H = 32) against float64: a few fp32 ulps of O(1)
# values; a bf16 head rounds the hidden states, the weight and the output to 8 bits (~4e-3).
FP32_ATOL = 1e-5
BF16_MIN_GAP = 1e-4


def _captured_hidden(engine):
    seen = []
    engine.module.body.register_forward_hook(
        lambda _m, _a, out: seen.append(out.last_hidden_state.detach())
    )
    return seen


def _check(got: torch.Tensor, hidden: torch.Tensor, head: torch.nn.Linear) -> None:
    weight = head.weight.detach()
    bias = None if head.bias is None else head.bias.detach()
    exact = torch.nn.functional.linear(
        hidden.double(), weight.double(), None if bias is None else bias.double()
    ).squeeze(-1)
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() < FP32_ATOL
    rounded = torch.nn.functional.linear(
        hidden.bfloat16(), weight.bfloat16(), None if bias is None else bias.bfloat16()
    ).squeeze(-1)
    assert (rounded.double() - exact).abs().max() > BF16_MIN_GAP  # the test can fail


def test_the_critics_value_head_is_fp32_under_bf16_autocast() -> None:
    config = CriticConfig(dtype="bfloat16", micro_batch_size=6, device="cpu")
    engine = CriticEngine(tiny_model(seed=1), config)
    seen = _captured_hidden(engine)
    batch = make_batch(6, 10, padding="none", seed=2)
    values = engine.infer_batch(batch)["values"]
    (hidden,) = seen
    # values[b, t] is the head at the hidden state of token t - 1 (token alignment).
    _check(values[:, 1:], hidden[:, :-1], engine.module.value_head)


@pytest.mark.parametrize("pack", [False, True])
def test_the_reward_models_score_head_is_fp32_under_bf16_autocast(pack: bool) -> None:
    config = EngineConfig(dtype="bfloat16", micro_batch_size=6, device="cpu", pack_sequences=pack)
    engine = RewardModelEngine(tiny_model(seed=3), config)
    seen = _captured_hidden(engine)
    batch = make_batch(6, 10, padding="none", seed=4).select("input_ids", "attention_mask")
    scores = engine.infer_batch(batch)["scores"]
    (hidden,) = seen
    last = hidden.reshape(6, 10, -1)[:, -1]  # packed [1, 60] or padded [6, 10]: rows of 10
    _check(scores, last, engine.module.value_head)
