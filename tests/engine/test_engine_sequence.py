"""Sequence-level roles: per-row outputs and inputs, group planning, the reward model.

docs/engine.md#sequence-level-roles: a role may return one value per sequence (``[b]``) computed
from the hidden state of each sequence's last real token (``last_index``), take per-row ``[B]``
batch keys, and count its denominators from a per-row key; rows sharing a ``group`` id are
planned into one micro-batch. ``RewardModelEngine`` is such a role (Bradley-Terry on pairs). How
critics and reward models export as transformers token / sequence classifiers:
tests/engine/checkpoint/test_export.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from engine_utils import VOCAB, assert_close_dicts, grads_of, make_batch, pair_batch, tiny_model
from sync_utils import ENGINE_DIR, count_syncs
from tensordict import TensorDict

from microrl.configs import CriticConfig, EngineConfig, OptimConfig
from microrl.engine import CriticEngine, Engine, RewardModelEngine
from microrl.engine.microbatch import micro_batch_cost, plan_micro_batches
from microrl.engine.models import ValueModel, decoder_body
from microrl.losses import Metric

SCORE_ATOL = 1e-5  # fp32: the same row through different layouts / row counts (GEMM blocking)


@torch.no_grad()
def reference_scores(module: ValueModel, batch: TensorDict) -> torch.Tensor:
    """Row by row without padding: the head at the hidden state of the row's last token."""
    was_training = module.training
    module.eval()
    scores = []
    for b in range(batch.batch_size[0]):
        cols = batch["attention_mask"][b].nonzero().squeeze(1)
        row = batch["input_ids"][b, cols].unsqueeze(0)
        hidden = module.body(input_ids=row, use_cache=False).last_hidden_state[0, -1]
        scores.append(module.value_head(hidden.to(module.value_head.weight.dtype)).squeeze(-1))
    module.train(was_training)
    return torch.stack(scores).float()


# ----------------------------------------------------------------- per-row outputs
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("padding", ["left", "right", "mixed"])
def test_scores_are_the_head_at_the_last_real_token(padding: str, packed: bool) -> None:
    config = EngineConfig(max_tokens_per_micro_batch=24, pack_sequences=packed)
    engine = RewardModelEngine(tiny_model(seed=1), config)
    batch = pair_batch(4, 12, padding=padding, seed=3)
    expected = reference_scores(engine.module, batch)
    scores = engine.infer_batch(batch)["scores"]
    assert scores.shape == (8,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, atol=SCORE_ATOL, rtol=0)
    # forward_step: the rows as one micro-batch, the same per-row outputs in the caller's order
    _, output, _ = engine.forward_step(batch, forward_only=True)
    torch.testing.assert_close(output["scores"], expected, atol=SCORE_ATOL, rtol=0)


def test_changing_only_the_last_token_changes_the_score() -> None:
    engine = RewardModelEngine(tiny_model(seed=1), EngineConfig(micro_batch_size=2))
    batch = pair_batch(3, 10, padding="mixed", seed=4)
    before = engine.infer_batch(batch)["scores"]
    changed = batch.clone()
    mask = batch["attention_mask"]
    last = mask.shape[1] - 1 - mask[0].flip(0).to(torch.int8).argmax()
    changed["input_ids"][0, last] = (batch["input_ids"][0, last] + 1) % VOCAB
    after = engine.infer_batch(changed)["scores"]
    assert (after[0] - before[0]).abs() > 1e-4, "the last token does not reach the score"
    torch.testing.assert_close(after[1:], before[1:], atol=SCORE_ATOL, rtol=0)


def test_a_head_output_of_another_shape_is_named() -> None:
    class Bad(RewardModelEngine):
        def _model_forward(self, input_ids, position_ids, attention_mask, targets, **kwargs):
            return {"scores": torch.zeros(3, device=input_ids.device)}

    engine = Bad(tiny_model(), EngineConfig(micro_batch_size=8))
    with pytest.raises(ValueError, match=r"output 'scores' has shape \(3,\): expected per-posit"):
        engine.infer_batch(pair_batch(4, 10))


# ----------------------------------------------------------------- per-row inputs
class SequenceRegressor(Engine):
    """A role with per-row inputs and a per-row denominator: weighted MSE of a score per row."""

    config_class = EngineConfig
    loss_keys = ()
    row_keys = ("label", "weight")
    count_key = "weight"

    def _build_module(self, causal_lm):
        hidden = causal_lm.get_input_embeddings().embedding_dim
        return ValueModel(decoder_body(causal_lm), hidden, sequence_level=True)

    def _model_forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        targets,
        *,
        training,
        last_index,
        temperature=None,
        **kwargs,
    ):
        return {"score": self.module(input_ids, position_ids, attention_mask, last_index, **kwargs)}

    def default_loss(self, output, micro_batch, denominators):
        error = (output["score"] - micro_batch["label"]) ** 2
        total = (micro_batch["weight"].to(error.dtype) * error).sum()
        metrics = {"mse": Metric((total.detach() / denominators.n_seqs).float())}
        return total / denominators.n_seqs * denominators.grad_scale, metrics


@pytest.mark.parametrize(
    ("mbs", "budget", "packed"), [(1, None, False), (4, None, False), (None, 20, True)]
)
def test_per_row_inputs_reach_the_loss_in_row_order(mbs, budget, packed) -> None:
    config = EngineConfig(
        micro_batch_size=mbs, max_tokens_per_micro_batch=budget, pack_sequences=packed
    )
    engine = SequenceRegressor(tiny_model(seed=2), config)
    batch = make_batch(7, 11, padding="mixed", seed=5).select("input_ids", "attention_mask")
    batch["label"] = torch.randn(7, generator=torch.Generator().manual_seed(0))
    batch["weight"] = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    batch["row_id"] = torch.arange(7)
    batch["aux"] = torch.arange(7).unsqueeze(1) * 10 + torch.arange(3)  # [B, K], K != T: per row

    seen = []

    def loss_fn(output, micro_batch, denominators):
        seen.append(micro_batch.select("row_id", "aux", "input_ids", "attention_mask").clone())
        return engine.default_loss(output, micro_batch, denominators)

    result = engine.forward_backward_batch(batch, loss_fn=loss_fn)
    rows = torch.cat([m["row_id"] for m in seen])
    assert sorted(rows.tolist()) == list(range(7))
    for micro in seen:
        torch.testing.assert_close(
            micro["aux"], micro["row_id"].unsqueeze(1) * 10 + torch.arange(3)
        )
        for i, row in enumerate(micro["row_id"].tolist()):  # the row's tokens sit next to its id
            cols = batch["attention_mask"][row].nonzero().squeeze(1)
            n = len(cols)
            assert torch.equal(micro["input_ids"][i, :n], batch["input_ids"][row, cols])
    scores = reference_scores(engine.module, batch).double()
    weight = batch["weight"].double()
    expected = (weight * (scores - batch["label"].double()) ** 2).sum() / weight.sum()
    assert abs(result["loss"] - expected.item()) <= 1e-5 * (1 + expected.item())
    assert abs(result["metrics"]["mse"] - expected.item()) <= 1e-5 * (1 + expected.item())
    assert result["model_output"]["score"].shape == (7,)


# ----------------------------------------------------------------- group planning
@pytest.mark.parametrize("seed", range(4))
def test_group_plan_keeps_groups_whole_and_respects_the_limits(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 30)
    lengths = [rng.randint(1, 40) for _ in range(n)]
    groups = [rng.randint(0, max(1, n // 3)) for _ in range(n)]
    members: dict[int, list[int]] = {}
    for row, gid in enumerate(groups):
        members.setdefault(gid, []).append(row)
    biggest = max(len(m) for m in members.values())
    plans = [(dict(micro_batch_size=biggest + rng.randint(0, 3)), False)]
    for packed in (False, True):
        need = max(
            micro_batch_cost([lengths[i] for i in m], packed=packed) for m in members.values()
        )
        plans.append((dict(max_tokens=need + rng.randint(0, 50), packed=packed), packed))
    for kwargs, packed in plans:
        for k_min in (1, 5):
            plan = plan_micro_batches(lengths, groups=groups, min_micro_batches=k_min, **kwargs)
            assert len(plan) >= k_min
            assert sorted(i for micro in plan for i in micro) == list(range(n))
            where = {i: j for j, micro in enumerate(plan) for i in micro}
            for rows in members.values():
                assert len({where[i] for i in rows}) == 1, (rows, plan)
            for micro in plan:
                if "micro_batch_size" in kwargs:
                    assert len(micro) <= kwargs["micro_batch_size"]
                elif len(micro) > 1:
                    cost = micro_batch_cost([lengths[i] for i in micro], packed=packed)
                    assert cost <= kwargs["max_tokens"], (micro, cost, kwargs)


def test_without_groups_each_row_is_its_own_group() -> None:
    rng = random.Random(7)
    lengths = [rng.randint(1, 40) for _ in range(25)]
    for kwargs in (
        dict(micro_batch_size=3),
        dict(max_tokens=60),
        dict(max_tokens=60, packed=True),
    ):
        assert plan_micro_batches(lengths, **kwargs) == plan_micro_batches(
            lengths, groups=list(range(25)), **kwargs
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(micro_batch_size=2), r"group 7 has 3 rows, more than micro_batch_size=2"),
        (dict(max_tokens=20), r"group 7 \(3 rows\) costs 30 tokens \(padded\), more than"),
        (dict(max_tokens=20, packed=True), r"group 7 \(3 rows\) costs 21 tokens \(packed\)"),
    ],
)
def test_a_group_over_the_limit_is_an_error(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_micro_batches([10, 4, 7, 7, 3], groups=[7, 7, 1, 7, 2], **kwargs)
    # a single row over the budget still runs alone, as without groups
    assert plan_micro_batches([30, 2], groups=[0, 1], max_tokens=20) == [[0], [1]]


@pytest.mark.usefixtures("intra_op_threads")
@pytest.mark.parametrize(
    ("mbs", "budget", "packed"),
    [(2, None, False), (4, None, False), (None, 24, False), (None, 30, True), (2, None, True)],
)
def test_pairwise_loss_is_exact_under_any_split(mbs, budget, packed) -> None:
    """fp64: loss, metrics and gradients of the Bradley-Terry loss do not depend on the split."""
    state = tiny_model(dtype=torch.float64).state_dict()
    batch = pair_batch(5, 12, padding="mixed", seed=8)

    def run(config):
        model = tiny_model(dtype=torch.float64)
        model.load_state_dict(state)
        engine = RewardModelEngine(model, config)
        groups_seen = []

        def loss_fn(output, micro_batch, denominators):
            groups_seen.append(micro_batch["group"].clone())
            return engine.default_loss(output, micro_batch, denominators)

        result = engine.forward_backward_batch(batch, loss_fn=loss_fn)
        return result, grads_of(engine.module), groups_seen

    reference, ref_grads, _ = run(EngineConfig(micro_batch_size=10))
    config = EngineConfig(
        micro_batch_size=mbs, max_tokens_per_micro_batch=budget, pack_sequences=packed
    )
    result, grads, groups_seen = run(config)
    assert len(groups_seen) > 1
    for groups in groups_seen:  # every pair whole in its micro-batch
        assert all((groups == g).sum() == 2 for g in groups)
    assert abs(result["loss"] - reference["loss"]) <= 1e-7 + 2e-6 * abs(reference["loss"])
    assert_close_dicts(result["metrics"], reference["metrics"], rtol=2e-6, atol=1e-7)
    assert_close_dicts(grads, ref_grads, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(
        result["model_output"]["scores"], reference["model_output"]["scores"], rtol=0, atol=1e-6
    )


def test_actor_batches_with_groups_stay_exact() -> None:
    """The ``group`` key is the planner's for every role: a critic's loss is unchanged by it."""
    state = tiny_model(dtype=torch.float64).state_dict()
    batch = make_batch(6, 10, padding="mixed", seed=9, dtype=torch.float64)

    def run(config, groups=None):
        model = tiny_model(dtype=torch.float64)
        model.load_state_dict(state)
        engine = CriticEngine(model, config)
        data = batch.clone()
        if groups is not None:
            data["group"] = torch.tensor(groups)
        return engine.forward_backward_batch(data), grads_of(engine.module)

    reference, ref_grads = run(CriticConfig(micro_batch_size=6))
    result, grads = run(CriticConfig(micro_batch_size=3), groups=[0, 1, 0, 1, 2, 2])
    assert abs(result["loss"] - reference["loss"]) <= 1e-7 + 2e-6 * abs(reference["loss"])
    assert_close_dicts(grads, ref_grads, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------- the reward model
def preference_set(n_pairs: int, seed: int) -> TensorDict:
    """Toy preferences: a random prompt, then a response; the chosen response ends in token 5,
    the rejected one in token 9 (a rule the score must learn from the last token)."""
    batch = pair_batch(n_pairs, 10, padding="mixed", seed=seed)
    mask = batch["attention_mask"]
    last = mask.shape[1] - 1 - mask.flip(1).to(torch.int8).argmax(dim=1)
    rows = torch.arange(len(last))
    batch["input_ids"][rows, last] = torch.where(batch["chosen"], 5, 9)
    return batch


def test_reward_model_learns_preferences() -> None:
    config = EngineConfig(micro_batch_size=4, optim=OptimConfig(lr=1e-3))
    engine = RewardModelEngine(tiny_model(seed=4), config)
    train, held_out = preference_set(8, seed=10), preference_set(8, seed=11)

    def accuracy(batch):
        scores = engine.infer_batch(batch)["scores"]
        chosen = batch["chosen"]
        by_group = {}
        for s, g, c in zip(scores.tolist(), batch["group"].tolist(), chosen.tolist(), strict=True):
            by_group.setdefault(g, {})[c] = s
        return sum(v[True] > v[False] for v in by_group.values()) / len(by_group)

    before = accuracy(held_out)
    first = engine.train_batch(train)
    assert {"loss", "bt_loss", "accuracy", "margin", "grad_norm"} <= first.keys()
    assert first["accuracy"] < 0.5 and first["margin"] < 0  # the random head prefers token 9
    for _ in range(3):
        last = engine.train_batch(train)
    assert last["loss"] < 0.1 * first["loss"], (first, last)
    assert last["accuracy"] == 1.0 and last["margin"] > 1.0
    assert before < 0.5 and accuracy(held_out) == 1.0


def test_reward_model_metrics_match_a_direct_computation() -> None:
    engine = RewardModelEngine(tiny_model(seed=6), EngineConfig(micro_batch_size=2))
    batch = pair_batch(4, 10, seed=12)
    scores = reference_scores(engine.module, batch).double()
    margins = []
    for g in range(4):
        rows = (batch["group"] == g).nonzero().squeeze(1)
        c = rows[batch["chosen"][rows]].item()
        r = rows[~batch["chosen"][rows]].item()
        margins.append(scores[c] - scores[r])
    margins = torch.stack(margins)
    result = engine.forward_backward_batch(batch)
    expected_loss = -torch.nn.functional.logsigmoid(margins).mean().item()
    assert abs(result["loss"] - expected_loss) <= 1e-5
    assert result["metrics"]["accuracy"] == pytest.approx((margins > 0).double().mean().item())
    assert result["metrics"]["margin"] == pytest.approx(margins.mean().item(), abs=1e-5)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.set("group", b["group"].float()), r"'group' must be an integer tensor \[B\]"),
        (lambda b: b.set("group", b["group"] > 0), r"'group' must be an integer tensor \[B\]"),
        (
            lambda b: b.set("group", b["input_ids"] % 3),
            r"'group' must be an integer tensor \[B\] = \(8,\)",
        ),
        (
            lambda b: b.set("chosen", b["attention_mask"]),
            r"'chosen' must be a per-row tensor \[B\] = \(8,\)",
        ),
        (lambda b: b.set("chosen", b["chosen"].float()), "'chosen' must be a bool"),
        (lambda b: b.set("chosen", b["chosen"].long() * 2), "'chosen' must hold only 0 and 1"),
        (lambda b: b.set("chosen", torch.ones(8, dtype=torch.bool)), "exactly one of them chosen"),
        (
            lambda b: b.set("group", torch.tensor([0, 0, 0, 1, 2, 2, 3, 3])),
            r"must be one pair: .* \(first at row 0: group 0, 3 row\(s\)",
        ),
        (lambda b: b.exclude("group"), r"missing required key\(s\) \['group'\]"),
    ],
)
def test_bad_reward_model_batches_are_named(mutate, message) -> None:
    engine = RewardModelEngine(tiny_model(), EngineConfig(micro_batch_size=4))
    batch = pair_batch(4, 10, seed=13)
    with pytest.raises(ValueError, match=message):
        engine.train_batch(mutate(batch))


def test_a_pair_over_the_token_budget_is_an_error() -> None:
    engine = RewardModelEngine(tiny_model(), EngineConfig(max_tokens_per_micro_batch=12))
    batch = pair_batch(2, 10, padding="right", seed=14)
    batch["attention_mask"][:] = True  # every row 10 tokens: a pair costs 20 > 12
    with pytest.raises(ValueError, match=r"costs 20 tokens \(padded\), more than the token budget"):
        engine.train_batch(batch)


def test_reward_model_syncs_do_not_grow_with_micro_batches() -> None:
    def count(mbs):
        engine = RewardModelEngine(tiny_model(), EngineConfig(micro_batch_size=mbs))
        batch = pair_batch(3, 10, seed=15)
        with count_syncs(dirs=(ENGINE_DIR,)) as sites:
            engine.forward_backward_batch(batch)
        return sites

    one, three = count(6), count(2)
    assert any(site.startswith("reward.py") for site in one), "probe blind"
    assert three == one, f"syncs per micro-batch from engine code: {dict(three - one)}"


def test_the_docs_reward_model_example_runs() -> None:
    """The subclassing example of docs/engine.md (a pairwise reward model) runs as written."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "engine.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "(Engine)" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/engine.md example", "exec"), {"__name__": "docs_example"})
