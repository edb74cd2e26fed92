"""Episodes under data parallelism: ranks whose episodes end at different turns stay in step.

The ``hf`` backend samples an FSDP2-sharded model with ``synced_gpus``: every generate call is a
collective, so a rank whose episodes have all ended must keep sampling while another plays on.
Rank 0's environments want 3 turns, rank 1's end after 1; both ranks must finish, and each
rank's engine must score its episode batch at the sampled log-probs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the ranks
from distributed_utils import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).resolve()


def test_ranks_with_different_episode_lengths_play_in_step(tmp_path):
    launch(2, HERE, str(tmp_path), timeout=180)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["turns"] == [3, 3, 3, 3] and results[1]["turns"] == [1, 1, 1, 1]
    assert results[0]["truncated"] == [True] * 4 and results[1]["truncated"] == [False] * 4
    for r in results:
        assert r["max_logprob_diff"] < 1e-5


class TurnsEnv:
    """Done after ``turns`` turns; every other reply is the hint ``+``."""

    def __init__(self, turns: int) -> None:
        self.turns, self.seen = turns, 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.seen += 1
        done = self.seen >= self.turns
        obs = [] if done else [{"role": "user", "content": "+"}]
        return {"observations": obs, "reward": float(done), "done": done}


def main(tmp: str) -> None:
    import torch

    from microrl.configs import ActorConfig
    from microrl.configs.run import ModelConfig
    from microrl.engine import ActorEngine
    from microrl.engine.parallel import distributed
    from microrl.rollout import HFRollout, SamplingParams
    from microrl.run.toy_model import build_model, build_tokenizer

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, intermediate_size=64, num_heads=2), tok)
    engine = ActorEngine(model, ActorConfig(micro_batch_size=2))
    assert distributed.is_distributed()
    torch.manual_seed(rank)
    turns = 4 if rank == 0 else 1  # rank 0: cut by max_turns=3
    rollout = HFRollout(engine, tok).run_episodes(
        ["1+2=", "30+4="],
        lambda i: TurnsEnv(turns),
        SamplingParams(num_samples=2, max_new_tokens=3),
        max_turns=3,
        max_tokens=20,
    )
    batch = rollout.batch
    scored = engine.infer_batch(batch)["logprobs"]
    mask = batch["loss_mask"]
    diff = (scored[mask] - batch["rollout_logprobs"][mask]).abs().max().item()
    result = {
        "turns": rollout.num_turns.tolist(),
        "truncated": batch["truncated"].tolist(),
        "max_logprob_diff": diff,
    }
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
