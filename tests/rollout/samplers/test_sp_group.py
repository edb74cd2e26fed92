"""One sampler per sequence-parallel group (microrl/rollout/samplers/sp_group.py), on 2 gloo ranks.

The group's first process drives a scripted sampler; the second has none. Both see the same
versions and the same rollouts (the first one's, broadcast), their torch generators stay in step
(each job's seed is drawn on both), every push is joined by the second, and an error of the
sampler reaches both. The worker's model runs the attention the engine's Ulysses wrapper
wraps. The recipe under ``torchrun``: tests/examples/test_examples_sequence_parallel.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks

from microrl.rollout import Rollout, SamplingParams
from microrl.rollout.base import draw_seed
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, WorkerError
from microrl.rollout.samplers.hf_worker import unwrapped_attention

HERE = Path(__file__).resolve()
PARAMS = SamplingParams(num_samples=2, max_new_tokens=3)


class ScriptedSampler:
    """Jobs draw their seed from torch's generator (as every sampler does); a rollout's tokens
    are its seed's draws, so two processes sampling on their own would differ."""

    def __init__(self) -> None:
        self.version, self.sync_stats, self.jobs, self.closed = 0, {}, {}, False

    def submit(self, prompts, params) -> Job:
        job = Job(len(self.jobs), self.version, "generate")
        self.jobs[job.id] = (draw_seed(params), len(prompts) * params.num_samples)
        return job

    def submit_episodes(self, problems, params, **limits) -> Job:
        job = Job(len(self.jobs), self.version, "episodes")
        self.jobs[job.id] = (draw_seed(params), None)  # its environment fails
        return job

    def collect(self, job: Job) -> Rollout:
        seed, rows = self.jobs.pop(job.id)
        if rows is None:
            raise ValueError("an environment failed")
        ids = torch.randint(100, (rows, 3), generator=torch.Generator().manual_seed(seed))
        batch = TensorDict(
            {"input_ids": ids, POLICY_VERSION_KEY: torch.full((rows,), job.version)},
            batch_size=[rows],
        )
        return Rollout(batch=batch, texts=[str(r) for r in ids.tolist()], group_ids=ids[:, 0])

    def sync(self, engine) -> None:
        self.version += 1
        self.sync_stats[self.version] = {"sync/probe_kl": 0.1 * self.version}

    def poll(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_worker_builds_the_attention_the_engine_wraps() -> None:
    """Sequence parallelism registers a Ulysses wrapper in the trainer process only: the
    worker's model runs the plain attention under it (and under packing's varlen one)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    for wrapped, plain in [
        ("microrl_ulysses_sdpa", "sdpa"),
        ("microrl_varlen_eager", "eager"),
        ("sdpa", "sdpa"),
    ]:
        config._attn_implementation = wrapped
        assert unwrapped_attention(config)._attn_implementation == plain
        assert config._attn_implementation == wrapped  # the engine's own config is untouched


@pytest.mark.distributed
def test_the_group_shares_one_sampler(tmp_path: Path) -> None:
    from distributed_utils import launch

    launch(2, HERE, str(tmp_path))
    leader, other = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert leader["rollouts"] == other["rollouts"]  # the first process's, on both
    assert [r["version"] for r in leader["rollouts"]] == [0, 0, 1]
    assert leader["after"] == other["after"]  # torch's generator in step on both
    assert leader["versions"] == other["versions"] == [0, 1]
    assert leader["joined"] == 0 and other["joined"] == 1  # the push, joined by the second
    assert other["stats"] == {"1": {"sync/probe_kl": 0.1}}  # the checks travel with a rollout
    assert "ValueError: an environment failed" in leader["error"]
    assert other["error"].startswith("WorkerError: the sampler of this sequence-parallel group")
    assert leader["closed"]


def _rank_main(tmp: Path) -> None:
    import torch.distributed as dist

    from microrl.rollout.samplers.sp_group import SPGroupSampler
    from microrl.run import Dist

    dist_info = Dist.init()
    rank, joined = dist_info.rank, []
    torch.manual_seed(7)  # the same seed on both: one data rank
    sampler = ScriptedSampler() if rank == 0 else None
    join = None if rank == 0 else (lambda engine: joined.append(engine))
    group = SPGroupSampler(
        sampler, dist.group.WORLD, version=0, join_push=join, env_maker=lambda problem: None
    )
    versions = [group.version]
    jobs = [group.submit(["1+1=", "2+2="], PARAMS), group.submit(["3+3="], PARAMS)]
    group.sync("engine")
    versions.append(group.version)
    jobs.append(group.submit(["4+4="], PARAMS))
    group.poll()
    rollouts = []
    for job in jobs:
        rollout = group.collect(job)
        rollouts.append(
            {
                "ids": rollout.batch["input_ids"].tolist(),
                "version": int(rollout.batch[POLICY_VERSION_KEY][0]),
                "texts": rollout.texts,
            }
        )
    stats = {str(v): s for v, s in group.sync_stats.items()}
    error = ""
    try:
        group.collect(group.submit_episodes(["5+5="], PARAMS, max_turns=2, max_tokens=8))
    except (ValueError, WorkerError) as err:
        error = f"{type(err).__name__}: {err}"
    group.close()
    out = {
        "rollouts": rollouts,
        "after": torch.rand(3).tolist(),
        "versions": versions,
        "joined": len(joined),
        "stats": stats,
        "error": error,
        "closed": sampler.closed if sampler else True,
    }
    (tmp / f"rank{rank}.json").write_text(json.dumps(out))
    dist_info.close()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
