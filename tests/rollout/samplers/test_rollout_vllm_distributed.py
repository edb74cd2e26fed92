"""The vllm rollout backend under torchrun: every rank owns a vLLM engine beside its FSDP2 shard.

One launch of this file (``distributed_utils.launch``) with 2 gloo ranks: for a LoRA and a full fine-tune engine
(sharded by FSDP2), each rank samples its own prompts with its own vLLM engine, trains one step
on them (a collective update), syncs (the adapter written once and loaded by every rank; the full
weights all-gathered on every rank), and checks vLLM's log-probs against the engine's before and
after. Closing vLLM must leave the trainer's process group alive. The ranks write what they
measured; the pytest function asserts on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # tests/, for the ranks
from distributed_utils import launch  # noqa: E402

# As in test_rollout_vllm.py: measured <= 5e-7 between vLLM's CPU kernels and the engine.
LOGPROB_ATOL = 1e-4


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_sample_and_sync_their_own_vllm(tmp_path):
    launch(2, HERE, str(tmp_path), timeout=420)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for mode in ("lora", "full"):
            got = result[mode]
            assert got["sharded"], f"{mode}: the engine should be FSDP2-sharded under torchrun"
            assert got["sampled_vs_engine"] <= LOGPROB_ATOL, (rank, mode, got)
            assert got["moved"] > 1e-2, (rank, mode, got)  # the update changed the policy
            assert got["stale_vs_old"] <= LOGPROB_ATOL, (rank, mode, got)  # before the sync
            assert got["synced_vs_new"] <= LOGPROB_ATOL, (rank, mode, got)  # after it
        assert result["group_alive_after_close"]


def _masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return ((a - b).abs() * mask).max().item()


def _check(mode: str, lora_rank: int, rank: int, workdir: Path) -> dict:
    from torch.distributed.fsdp import FSDPModule

    from microrl.configs import ActorConfig, LoraConfig, OptimConfig
    from microrl.configs.rollout import VLLMConfig
    from microrl.configs.run import ModelConfig
    from microrl.engine import ActorEngine
    from microrl.rollout import SamplingParams, VLLMRollout
    from microrl.run.toy_model import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model_config = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2)
    torch.manual_seed(0)  # the same initial weights and LoRA on every rank
    engine = ActorEngine(
        build_model(model_config, tokenizer),
        ActorConfig(
            micro_batch_size=4, optim=OptimConfig(lr=5e-2), lora=LoraConfig(rank=lora_rank)
        ),
    )
    rollout = VLLMRollout(engine, tokenizer, VLLMConfig(max_model_len=32), workdir=str(workdir))
    try:
        prompts = [["1+2=", "35+7="], ["9+99=", "40+4="]][rank]  # each rank its own prompts
        params = SamplingParams(num_samples=2, max_new_tokens=5, seed=rank)
        batch = rollout.generate(prompts, params).batch
        loss_mask, attention = batch["loss_mask"].float(), batch["attention_mask"].float()
        before = engine.infer_batch(batch)["logprobs"]
        sampled = _masked_max(batch["rollout_logprobs"], before, loss_mask)
        train = batch.clone()
        train["old_logprobs"] = before
        train["advantages"] = loss_mask
        engine.train_batch(train)
        after = engine.infer_batch(batch)["logprobs"]
        rows = [
            ids[m].tolist() for ids, m in zip(batch["input_ids"], attention.bool(), strict=True)
        ]

        def scored() -> torch.Tensor:
            out = torch.zeros_like(after)
            for b, values in enumerate(rollout.score(rows)):
                out[b, attention[b].bool()] = torch.tensor(values)
            return out

        stale = _masked_max(scored(), before, attention)
        rollout.sync(engine)
        return {
            "sharded": isinstance(engine.module, FSDPModule),
            "sampled_vs_engine": sampled,
            "moved": _masked_max(after, before, loss_mask),
            "stale_vs_old": stale,
            "synced_vs_new": _masked_max(scored(), after, attention),
        }
    finally:
        rollout.close()


def main(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(out_dir)
    result = {
        "lora": _check("lora", 8, rank, out / "lora"),
        "full": _check("full", 0, rank, out / "full"),
    }
    dist.barrier()  # fails if closing vLLM ended the trainer's process group
    result["group_alive_after_close"] = dist.is_initialized()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
