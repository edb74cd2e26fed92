"""A vision-language model under FSDP2 on 2 gloo ranks equals one process (docs/engine.md#images).

The tiny Qwen2-VL of tests/engine/vision_utils.py, vision tower trainable, one SGD step: rank 0
holds the rows with images, rank 1 only text rows (one real micro-batch, one empty), so it runs the
sharded tower on placeholder images to keep FSDP2's collectives in step. The update of every
parameter, tower included, equals the one-process update on the whole mini-batch; the tower's
blocks are FSDP2 units; the grad-flow audit (error mode) agrees on every rank.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # tests/, for the ranks
sys.path.insert(0, str(HERE.parents[1]))  # tests/engine/
from distributed_utils import ATOL, full_params, launch, single_process  # noqa: E402

SHARDS = ([0, 2, 3, 5], [1, 4])  # rank 1: the two rows without an image


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_vlm_update_equals_one_process(tmp_path):
    (tmp_path / "out").mkdir()
    launch(2, HERE, str(tmp_path))
    passed = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert passed[0] == passed[1] == ["tower_blocks_are_units", "update_equals_one_process"]


def _engine():
    from vision_utils import tiny_vlm

    from microrl import ActorEngine
    from microrl.configs.engine import ActorConfig, LoraConfig, OptimConfig

    config = ActorConfig(
        micro_batch_size=2,
        lora=LoraConfig(rank=0),
        freeze_vision=False,
        check_grad_flow="error",
        optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None),  # update = -gradient
    )
    return ActorEngine(tiny_vlm("qwen2_vl"), config)


def _delta(engine, batch):
    before = full_params(engine)
    engine.train_batch(batch)
    return {n: p - before[n] for n, p in full_params(engine).items()}


def main(tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from vision_utils import make_image_batch

    rank = int(os.environ["RANK"])
    batch = make_image_batch()
    assert not batch["image_grid_thw"][SHARDS[1]].any()
    ref = single_process(lambda: _delta(_engine(), batch))
    engine = _engine()
    passed = []
    assert all(isinstance(block, FSDPModule) for block in engine.vision.tower.blocks)
    passed.append("tower_blocks_are_units")
    calls = []
    engine.vision.tower.register_forward_hook(lambda *_: calls.append(1))
    delta = _delta(engine, batch[SHARDS[rank]])
    assert len(calls) == 2, calls  # every micro-batch, placeholder images on rank 1
    assert delta.keys() == ref.keys()
    for name, d in delta.items():
        err = (d - ref[name]).abs().max().item()
        assert err <= ATOL, f"{name}: max |diff| {err:.3g} > {ATOL}"
    assert any(".visual." in n and ref[n].abs().max() > 0 for n in ref)
    passed.append("update_equals_one_process")
    dist.barrier()
    (Path(tmp) / "out" / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
