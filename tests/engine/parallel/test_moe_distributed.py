"""Mixture-of-experts models under FSDP2 on 2 gloo ranks (engine/moe/, engine/parallel/).

* The load-balancing loss over both ranks' shares is the model's own loss of the whole
  mini-batch (float64 reference, one padded forward): the load fractions are summed over the
  ranks before the first backward, for Qwen3-MoE (one row per micro-batch, so the rank with fewer
  rows runs fillers) and GPT-OSS (packed).
* Routing replay with LoRA on attention and the fused experts and the router loss on: the
  2-rank update, loss and metrics are the one-process update's.
* The sharded engine exports a PEFT adapter and a merged model that give its log-probs, and
  its checkpoint loads back into a fresh sharded engine.

Same harness as ``test_distributed.py``: the pytest function launches this file on 2 ranks; the
ranks write the names of the checks that passed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import assert_max_close, full_params, full_tensor, launch, single_process

HERE = Path(__file__).resolve()
SHARDS = ([0, 1, 2, 3], [4, 5])
COEF = 0.5
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# The model's own loss sums in float32 (transformers' load_balancing_loss_func).
REFERENCE_ATOL = 1e-6
ATOL = 2e-6  # fp32: the ranks sum partial gradients in another order than one process


@pytest.mark.distributed
@pytest.mark.slow
def test_moe_models_train_export_and_checkpoint_on_two_ranks(tmp_path):
    (tmp_path / "out").mkdir()
    launch(2, HERE, "moe", str(tmp_path), timeout=480)
    passed = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert passed[0] == passed[1], passed
    assert passed[0] == [
        "aux_loss_is_the_models_own_over_both_ranks[qwen3_moe]",
        "aux_loss_is_the_models_own_over_both_ranks[gpt_oss]",
        "replay_with_lora_on_experts_is_the_one_process_update",
        "exports_give_the_sharded_engines_logprobs",
        "checkpoint_loads_into_a_fresh_sharded_engine",
    ]


# ============================================================================ rank side


def _batch(dtype=torch.float64):
    from engine_utils import make_batch

    return make_batch(6, 12, padding="mixed", seed=4, dtype=dtype)


def _no_policy_loss(output, micro_batch, denominators):
    return (output["logprobs"] * 0).sum(), {}


def _check_aux_loss(family: str, rank: int) -> None:
    from moe_utils import aux_loss_reference, tiny_moe

    from microrl.configs import ActorConfig, OptimConfig
    from microrl.engine import ActorEngine
    from microrl.losses import RouterLossConfig

    batch = _batch()
    value, expected = aux_loss_reference(family, batch, COEF)
    split = {"micro_batch_size": 1} if family == "qwen3_moe" else {
        "max_tokens_per_micro_batch": 20, "pack_sequences": True}  # fmt: skip
    config = ActorConfig(
        **split,
        router_loss=RouterLossConfig(aux_loss_coef=COEF),
        optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None),
    )
    engine = ActorEngine(tiny_moe(family, dtype=torch.float64), config)
    result = engine.forward_backward_batch(batch[SHARDS[rank]], loss_fn=_no_policy_loss)
    assert result["metrics"]["router/aux_loss"] == pytest.approx(value, rel=1e-6)
    for name, param in engine.module.named_parameters():
        want = expected[name]
        got = full_tensor(param.grad) if param.grad is not None else torch.zeros_like(want)
        assert_max_close(got, want, f"{family} {name}", atol=REFERENCE_ATOL)


def _replay_engine():
    from moe_utils import tiny_moe

    from microrl.configs import ActorConfig, LoraConfig, OptimConfig
    from microrl.engine import ActorEngine
    from microrl.losses import RouterLossConfig

    config = ActorConfig(
        micro_batch_size=2,
        lora=LoraConfig(rank=4, alpha=8.0, target_parameters=EXPERTS),
        router_loss=RouterLossConfig(aux_loss_coef=0.1, z_loss_coef=0.01),
        optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None),
    )
    return ActorEngine(tiny_moe("qwen3_moe"), config)


def _replay_batch():
    from microrl.engine.moe import ROUTED_EXPERTS_KEY

    batch = _batch(torch.float32)
    scores = torch.rand(6, 12, 2, 4, generator=torch.Generator().manual_seed(5))
    batch[ROUTED_EXPERTS_KEY] = scores.argsort(-1)[..., :2].to(torch.int16)
    return batch


def scenario_moe(rank: int, tmp: Path) -> list[str]:
    import torch.distributed as dist
    from export_utils import check_lm_exports
    from moe_utils import tiny_moe

    passed = []
    for family in ("qwen3_moe", "gpt_oss"):
        _check_aux_loss(family, rank)
        passed.append(f"aux_loss_is_the_models_own_over_both_ranks[{family}]")

    batch = _replay_batch()

    def reference():
        engine = _replay_engine()
        for _ in range(2):  # the second step starts from adapters moved by the first
            result = engine.train_batch(batch)
        return full_params(engine), result

    ref_params, ref_metrics = single_process(reference)
    engine = _replay_engine()
    for _ in range(2):
        metrics = engine.train_batch(batch[SHARDS[rank]])
    for name, value in full_params(engine).items():
        assert_max_close(value, ref_params[name], name, atol=ATOL)
    routing = ("router/agreement", "router/routed_as_sampled", "router/aux_loss", "router/z_loss")
    for key in ("loss", *routing, "pg_loss"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
    passed.append("replay_with_lora_on_experts_is_the_one_process_update")

    plain = _batch(torch.float32)
    expected = engine.infer_batch(plain)["logprobs"]
    check_lm_exports(engine, plain, expected, tmp / "exports", rank=rank,
                     base=lambda: tiny_moe("qwen3_moe"))  # fmt: skip
    passed.append("exports_give_the_sharded_engines_logprobs")

    engine.save_checkpoint(tmp / "ckpt")
    fresh = _replay_engine()
    fresh.load_checkpoint(tmp / "ckpt")
    saved, loaded = full_params(engine), full_params(fresh)
    for name, value in saved.items():
        assert torch.equal(value, loaded[name]), name
    dist.barrier()
    passed.append("checkpoint_loads_into_a_fresh_sharded_engine")
    return passed


def main(scenario: str, tmp: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    passed = globals()[f"scenario_{scenario}"](rank, Path(tmp))
    dist.barrier()
    (Path(tmp) / "out" / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
