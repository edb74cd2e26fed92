"""The reward model on 2 gloo ranks: pair-count denominators, empty micro-batches, exports, its
engine checkpoint saved from the shards then read back on each rank alone, and a
``task.reward_model`` scorer sharded over the ranks (never whole on each) scoring as one process.

Like tests/engine/parallel/test_distributed.py, the pytest function launches this file on 2 ranks
(``distributed_utils.launch``) and the ranks report the checks that passed. References are
computed in the same processes before the process group exists (an unsharded engine on the whole
mini-batch).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the ranks
from distributed_utils import (
    assert_max_close,
    assert_metrics_close,
    full_params,
    launch,
    pair_batch,
    single_process,
    tiny_model,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).resolve()
# Whole pairs per rank, uneven: with micro_batch_size=2 (one pair) rank 0 runs 3 micro-batches
# and rank 1 one real and two empty ones (their `chosen` zeroed: no pair, no contribution).
SHARDS = ([0, 1, 2, 3, 4, 5], [6, 7])


def test_reward_model_under_data_parallelism(tmp_path):
    from model_reward_utils import save_reward_model

    (tmp_path / "out").mkdir()
    save_reward_model(tmp_path / "rm", seed=3)
    launch(2, HERE, str(tmp_path))
    passed = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert (
        passed[0]
        == passed[1]
        == [
            "dp_invariance",
            "empty_share",
            "export_under_fsdp",
            "checkpoint_as_classifier",
            "scorer_sharded",
        ]
    )


# ============================================================================ rank side


def main(tmp: str) -> None:
    import torch
    import torch.distributed as dist
    from export_utils import SCORE_ATOL, check_sequence_classifier_export, hf_scores
    from torch.distributed.fsdp import FSDPModule

    from microrl.configs import EngineConfig, LoraConfig, OptimConfig
    from microrl.engine import RewardModelEngine
    from microrl.engine.checkpoint.reward_model import load_reward_model_checkpoint
    from microrl.engine.parallel import distributed as D
    from microrl.tasks.reward_model import RewardModelScorer

    rank = int(os.environ.get("RANK", "0"))
    batch = pair_batch()
    config = EngineConfig(
        micro_batch_size=2,
        lora=LoraConfig(rank=4, alpha=8.0),
        optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None),
    )

    def step(engine, data):
        before = full_params(engine)
        metrics = engine.train_batch(data)
        return metrics, {n: p - before[n] for n, p in full_params(engine).items()}

    # The scorer's rows: 3 on rank 0, none on rank 1 (it still joins the collective forward).
    prompts, completions = ["12+7=", "3+4=", "99+1="], ["19", "7", "100"]
    mine = slice(0, 3) if rank == 0 else slice(0, 0)

    def references():
        whole = step(RewardModelEngine(tiny_model(), config), batch)
        first = step(RewardModelEngine(tiny_model(), config), batch[list(SHARDS[0])])
        scores = RewardModelScorer(str(Path(tmp) / "rm"), batch_size=2)(completions, prompts)
        return whole, first, scores

    (ref_metrics, ref_delta), (first_metrics, first_delta), ref_scores = single_process(references)
    passed = []

    # ---- the same update, loss and metrics from two shares of whole pairs
    engine = RewardModelEngine(tiny_model(), config)
    assert D.dp_group() is not None and isinstance(engine.module, FSDPModule)
    metrics, delta = step(engine, batch[list(SHARDS[rank])])
    assert_metrics_close(ref_metrics, metrics, "dp")
    for n, d in delta.items():
        assert_max_close(d, ref_delta[n], f"dp {n}")
    passed.append("dp_invariance")

    # ---- a rank with no row: placeholder micro-batches, [0] scores
    engine = RewardModelEngine(tiny_model(), config)
    share = batch[list(SHARDS[0])] if rank == 0 else batch[:0]
    metrics, delta = step(engine, share)
    assert_metrics_close(first_metrics, metrics, "empty share")
    for n, d in delta.items():
        assert_max_close(d, first_delta[n], f"empty share {n}")
    scores = engine.infer_batch(share)["scores"]
    assert scores.shape == (len(share),), scores.shape
    passed.append("empty_share")

    # ---- the merged export is gathered from the shards and loads as a sequence classifier
    expected = engine.infer_batch(batch)["scores"]
    check_sequence_classifier_export(engine, batch, expected, Path(tmp) / "merged", rank=rank)
    passed.append("export_under_fsdp")

    # ---- its engine checkpoint, saved from the shards, read back by each rank alone (no
    # collective: task.reward_model) as that classifier, LoRA merged
    engine.save_checkpoint(Path(tmp) / "ckpt")
    local = load_reward_model_checkpoint(Path(tmp) / "ckpt", tiny_model())
    torch.testing.assert_close(hf_scores(local, batch), expected, atol=SCORE_ATOL, rtol=0)
    passed.append("checkpoint_as_classifier")

    # ---- task.reward_model under torchrun: FSDP2-sharded (each rank holds half of it, rank 0
    # read the checkpoint), scoring collectively, as one process does
    scorer = RewardModelScorer(str(Path(tmp) / "rm"), batch_size=2)
    assert scorer.collective and isinstance(scorer.engine.module, FSDPModule)
    body = [p for n, p in scorer.engine.module.named_parameters() if "value_head" not in n]
    local = sum(p.to_local().numel() for p in body)
    assert local <= sum(p.numel() for p in body) // 2 + 64, local  # 1/2, padding aside
    got = scorer(completions[mine], prompts[mine])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_scores[mine]), atol=1e-5, rtol=0)
    passed.append("scorer_sharded")

    dist.barrier()
    (Path(tmp) / "out" / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
