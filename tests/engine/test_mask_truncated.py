"""``actor.mask_truncated``: responses cut at ``max_new_tokens`` contribute no loss token (DAPO).

The engine zeroes the ``loss_mask`` of the rows the batch's ``truncated`` key marks before it
counts the mini-batch's denominators (engine/actor.py), so a masked batch must give exactly what
the same batch with those rows' ``loss_mask`` zeroed by hand gives: loss, metrics and gradients,
for every micro-batch split, on the fused and the kernel + loss paths and with a custom loss, and
on 2 gloo ranks (this file's rank side, launched as tests/engine/parallel/test_distributed.py
launches its own).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the ranks
from engine_utils import assert_close_dicts, grads_of, make_batch, tiny_model

from microrl.configs import ActorConfig, PolicyLossConfig
from microrl.engine import ActorEngine
from microrl.losses import aggregate, masked_partial_mean
from microrl.losses.metrics import Metric

HERE = Path(__file__).resolve()
B = 6
TRUNCATED = torch.tensor([False, True, False, False, True, False])
GRAD_RTOL, GRAD_ATOL = 1e-9, 1e-12  # fp64: reassociation noise only (test_engine_invariance.py)
RTOL, ATOL = 2e-6, 1e-7  # float32 metrics summed over micro-batches
# (micro_batch_size, max_tokens): one row, two rows, all rows, a token budget.
SPLITS = [(1, None), (2, None), (B, None), (None, 17)]


def _batch(seed: int = 21, dtype: torch.dtype = torch.float64):
    batch = make_batch(B, 10, padding="mixed", seed=seed, dtype=dtype)
    batch["ref_logprobs"] = batch["old_logprobs"] + 0.1
    batch["truncated"] = TRUNCATED.clone()
    return batch


def _by_hand(batch):
    """The reference: the truncated rows' loss_mask zeroed by hand, nothing else changed."""
    out = batch.clone()
    out["loss_mask"] = out["loss_mask"] & ~out["truncated"][:, None]
    return out


def custom_loss(output, micro_batch, denominators):
    """A custom loss_fn (the kernel + loss path): a REINFORCE term and a metric of its own."""
    mask = micro_batch["loss_mask"]
    per_token = -micro_batch["advantages"] * output["logprobs"]
    metrics = {"mean_logprob": Metric(masked_partial_mean(output["logprobs"], mask, denominators))}
    return aggregate(per_token, mask, "token-mean", denominators), metrics


def _config(path: str, mode: str, mbs, budget, *, mask: bool) -> ActorConfig:
    return ActorConfig(
        micro_batch_size=mbs,
        max_tokens_per_micro_batch=budget,
        loss_agg_mode=mode,
        fuse_loss=path == "fused",
        policy_loss=PolicyLossConfig(kl_coef=0.1),
        mask_truncated=mask,
    )


def _run(config: ActorConfig, state, batch, path: str):
    model = tiny_model("qwen2", dtype=torch.float64)
    model.load_state_dict(state)
    engine = ActorEngine(model, config)
    loss_fn = custom_loss if path == "custom" else None
    assert engine.fuses_loss(loss_fn) == (path == "fused"), path
    result = engine.forward_backward_batch(batch, loss_fn=loss_fn)
    return result, grads_of(engine.module)


@pytest.mark.parametrize(
    ("path", "mode"),
    [
        ("fused", "token-mean"),
        ("fused", "seq-mean-token-mean"),
        ("unfused", "token-mean"),
        ("unfused", "seq-mean-token-sum"),
        ("custom", "token-mean"),
    ],
)
def test_masking_equals_zeroing_the_loss_mask_by_hand_under_every_split(path, mode) -> None:
    batch = _batch()
    state = tiny_model("qwen2", dtype=torch.float64).state_dict()
    reference, ref_grads = _run(
        _config(path, mode, B, None, mask=False), state, _by_hand(batch), path
    )
    unmasked, _ = _run(_config(path, mode, B, None, mask=False), state, batch, path)
    assert abs(unmasked["loss"] - reference["loss"]) > 1e-6  # the truncated rows count otherwise
    assert any(g.abs().sum() > 0 for g in ref_grads.values())
    for mbs, budget in SPLITS:
        split = f"micro_batch_size={mbs} max_tokens={budget}"
        masked, grads = _run(_config(path, mode, mbs, budget, mask=True), state, batch, path)
        by_hand, hand_grads = _run(
            _config(path, mode, mbs, budget, mask=False), state, _by_hand(batch), path
        )
        # The same split: the very same computation.
        assert masked["loss"] == by_hand["loss"], split
        assert masked["metrics"] == by_hand["metrics"], split
        assert_close_dicts(grads, hand_grads, rtol=0, atol=0)
        # Any split: the mini-batch's loss, metrics and gradient.
        assert abs(masked["loss"] - reference["loss"]) <= ATOL + RTOL * abs(reference["loss"]), (
            split
        )
        assert_close_dicts(masked["metrics"], reference["metrics"], rtol=RTOL, atol=ATOL)
        assert_close_dicts(grads, ref_grads, rtol=GRAD_RTOL, atol=GRAD_ATOL)
        torch.testing.assert_close(
            masked["model_output"]["logprobs"], reference["model_output"]["logprobs"]
        )


@pytest.mark.parametrize("fuse", [True, False])
def test_an_all_truncated_mini_batch_has_zero_loss_and_gradient(fuse: bool) -> None:
    batch = _batch(dtype=torch.float32)
    batch["truncated"] = torch.ones(B, dtype=torch.bool)
    config = ActorConfig(micro_batch_size=2, fuse_loss=fuse, mask_truncated=True)
    engine = ActorEngine(tiny_model(), config)
    result = engine.forward_backward_batch(batch)
    assert result["loss"] == 0.0
    grads = grads_of(engine.module)
    assert all(torch.isfinite(g).all() and not g.any() for g in grads.values())
    for name in ("pg_loss", "pg_clipfrac", "ppo_kl"):
        assert result["metrics"][name] == 0.0, name
    metrics = engine.train_batch(batch)  # nothing to learn: the step is skipped
    assert metrics["step_skipped"] == 1.0 and metrics["loss"] == 0.0 and engine.global_step == 0


def test_a_batch_without_truncated_is_refused_for_training_only() -> None:
    batch = _batch(dtype=torch.float32).exclude("truncated")
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2, mask_truncated=True))
    for call in (engine.forward_backward_batch, engine.train_batch):
        with pytest.raises(ValueError, match=r"actor\.mask_truncated .*'truncated'"):
            call(batch)
    with pytest.raises(ValueError, match=r"actor\.mask_truncated"):
        engine.forward_step(batch)
    with pytest.raises(ValueError, match=r"actor\.mask_truncated .*'truncated'"):
        engine.forward_backward_batch(batch, loss_fn=custom_loss)
    assert engine.infer_batch(batch)["logprobs"].shape == batch["input_ids"].shape
    for bad in (torch.zeros(B), torch.zeros(B, 2, dtype=torch.bool)):
        batch["truncated"] = bad
        with pytest.raises(ValueError, match=r"'truncated' must be a bool .*actor\.mask_truncated"):
            engine.forward_backward_batch(batch)


def test_off_the_key_is_ignored_and_the_callers_batch_is_untouched() -> None:
    batch = _batch(dtype=torch.float32)
    before = batch["loss_mask"].clone()
    results = []
    for mask, data in ((False, batch), (False, batch.exclude("truncated")), (True, batch)):
        torch.manual_seed(0)
        engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2, mask_truncated=mask))
        results.append(engine.forward_backward_batch(data)["loss"])
    assert results[0] == results[1] != results[2]
    assert torch.equal(batch["loss_mask"], before)  # the engine masks its own copy
    # A 0/1 integer flag works like a bool one.
    engine = ActorEngine(tiny_model(), ActorConfig(micro_batch_size=2, mask_truncated=True))
    batch["truncated"] = TRUNCATED.long()
    assert engine.forward_backward_batch(batch)["loss"] == results[2]


def test_the_config_key() -> None:
    assert ActorConfig().mask_truncated is False
    with pytest.raises(ValueError, match="mask_truncated must be a bool"):
        ActorConfig(mask_truncated="yes")


# ============================================================================ data parallel


@pytest.mark.distributed
@pytest.mark.slow
def test_masking_is_exact_on_two_ranks(tmp_path: Path) -> None:
    from distributed_utils import launch

    launch(2, HERE, str(tmp_path))
    passed = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert passed[0] == passed[1] == ["fused", "unfused", "seq_mean_all_truncated_rank1"]


def _rank_main(tmp: Path) -> None:
    """Each rank trains its share of a 7-row mini-batch (rows 0-4 / 5-6) with the mask on; the
    reference is one process on all rows with the loss_mask zeroed by hand."""
    import torch.distributed as dist
    from distributed_utils import (
        actor_config,
        assert_max_close,
        assert_metrics_close,
        full_params,
        single_process,
    )
    from distributed_utils import make_batch as dp_batch
    from distributed_utils import tiny_model as dp_model

    rank = int(os.environ["RANK"])
    shards = ([0, 1, 2, 3, 4], [5, 6])
    cases = {
        "fused": ([False, True, False, False, True, False, True], {}),
        "unfused": ([True, False, False, True, False, False, True], {"fuse_loss": False}),
        # Rank 1's whole share is truncated: it contributes no loss token at all.
        "seq_mean_all_truncated_rank1": (
            [False, True, False, False, False, True, True],
            {"loss_agg_mode": "seq-mean-token-mean"},
        ),
    }
    batches = {}
    for name, (flags, _) in cases.items():
        batch = dp_batch()
        batch["truncated"] = torch.tensor(flags)
        batches[name] = batch

    def references():
        out = {}
        for name, (_, overrides) in cases.items():
            engine = ActorEngine(dp_model(), actor_config(lora=4, **overrides))
            before = full_params(engine)
            metrics = engine.train_batch(_by_hand(batches[name]))
            out[name] = (metrics, {n: p - before[n] for n, p in full_params(engine).items()})
        return out

    refs = single_process(references)
    passed = []
    for name, (_, overrides) in cases.items():
        torch.manual_seed(0)
        engine = ActorEngine(dp_model(), actor_config(lora=4, mask_truncated=True, **overrides))
        before = full_params(engine)
        metrics = engine.train_batch(batches[name][shards[rank]])
        ref_metrics, ref_delta = refs[name]
        assert_metrics_close(ref_metrics, metrics, name)
        for n, p in full_params(engine).items():
            assert_max_close(p - before[n], ref_delta[n], f"{name} {n}")
        passed.append(name)
    dist.barrier()
    (tmp / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
