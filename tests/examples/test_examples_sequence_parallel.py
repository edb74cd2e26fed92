"""The GRPO and PPO recipes under Ulysses sequence parallelism: 2 processes that are one data rank.

``torchrun --nproc_per_node 2 examples/grpo_lora.py actor.sequence_parallel_size=2`` samples
the prompts of one data rank on both processes (the same seeds), passes the engine the same
mini-batch and splits its tokens: it must train like the single-process run (the same prompts,
rewards and, to float32 rounding, losses), write its outputs once, and refuse what it cannot do.
``examples/ppo_lora.py`` does the same with ``actor.`` and ``critic.sequence_parallel_size=2``
(both engines split the tokens; the advantages are whitened over the data ranks only).
With ``rollout.max_staleness=1`` one worker samples for the sp group and its rollouts reach both
processes: the run trains like the single-process asynchronous run (on vLLM servers:
tests/examples/test_examples_sequence_parallel_servers.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import LENGTH_REWARD, TINY_MODEL, TINY_RL, load_example

from microrl.configs.engine import ActorConfig, CriticConfig, LoraConfig
from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.run import RolloutConfig
from microrl.run import Dist, read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["output.plot=false", "output.tensorboard=false", "train.steps=2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base model, warm-started by the first recipe run that needs it."""
    return tmp_path_factory.mktemp("base") / "tiny-adder"


def _torchrun(example: str, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(ROOT / "examples" / f"{example}.py"), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_grpo_under_sequence_parallelism_trains_like_one_process(
    base: Path, tmp_path: Path
) -> None:
    args = [*TINY_MODEL, *TINY_RL, *QUIET, f"model.path={base}"]
    one = tmp_path / "one"
    assert load_example("grpo_lora").main([*args, f"output.dir={one}"]) == 0
    sp = tmp_path / "sp"
    result = _torchrun("grpo_lora", [*args, f"output.dir={sp}", "actor.sequence_parallel_size=2"])
    assert result.stdout.count("held-out greedy accuracy:") == 1  # one data rank, one writer
    ref, got = read_metrics(one / "metrics.jsonl"), read_metrics(sp / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2]
    assert got[0]["eval/accuracy"] == ref[0]["eval/accuracy"]
    assert got[1]["reward"] == ref[1]["reward"]  # the same prompts and samples
    assert got[1]["loss"] == pytest.approx(ref[1]["loss"], abs=1e-5)
    for process in (0, 1):  # each process keeps its own loop state
        assert (sp / "checkpoint" / f"loop_state_rank{process}.pt").is_file()


def test_ppo_under_sequence_parallelism_trains_like_one_process(base: Path, tmp_path: Path) -> None:
    """Actor and critic both split the tokens; the GAE advantages are whitened over the data
    ranks (one process per sp group), so the first update is the single process's: the same
    rewards, and the actor's and the critic's losses to float32 rounding."""
    args = [*TINY_MODEL, *TINY_RL, *QUIET, f"model.path={base}", "critic.micro_batch_size=2"]
    one = tmp_path / "one"
    assert load_example("ppo_lora").main([*args, f"output.dir={one}"]) == 0
    sp = tmp_path / "sp"
    sizes = ["actor.sequence_parallel_size=2", "critic.sequence_parallel_size=2"]
    result = _torchrun("ppo_lora", [*args, f"output.dir={sp}", *sizes])
    assert result.stdout.count("held-out greedy accuracy:") == 1  # one data rank, one writer
    ref, got = read_metrics(one / "metrics.jsonl"), read_metrics(sp / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2]
    assert got[0]["eval/accuracy"] == ref[0]["eval/accuracy"]
    assert got[1]["reward"] == ref[1]["reward"]  # the same prompts and samples
    for key in ("loss", "critic/loss", "critic/vf_loss", "kl"):
        assert got[1][key] == pytest.approx(ref[1][key], abs=1e-5), key
    assert (sp / "checkpoint" / "critic").is_dir()
    for process in (0, 1):
        assert (sp / "checkpoint" / f"loop_state_rank{process}.pt").is_file()


def test_async_grpo_under_sequence_parallelism_trains_like_one_process(
    base: Path, tmp_path: Path
) -> None:
    """The group's first process's worker samples; the engine checks that both processes pass
    the same mini-batches. The same seeds and base weights sample the same rollouts as one
    process's worker: the same rewards and staleness, the losses to float32 rounding."""
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)  # rewards differ: the loss moves
    reward = f"task.rewards.functions=[{tmp_path / 'length_reward.py'}:length]"
    args = [*TINY_MODEL, *TINY_RL, *QUIET, f"model.path={base}", reward, "rollout.max_staleness=1"]
    one = tmp_path / "one"
    assert load_example("grpo_lora").main([*args, f"output.dir={one}"]) == 0
    sp = tmp_path / "sp"
    result = _torchrun("grpo_lora", [*args, f"output.dir={sp}", "actor.sequence_parallel_size=2"])
    assert result.stdout.count("held-out greedy accuracy:") == 1
    ref, got = read_metrics(one / "metrics.jsonl"), read_metrics(sp / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2]
    assert got[0]["eval/accuracy"] == ref[0]["eval/accuracy"]
    for step in (1, 2):  # both sampled with the base weights (k = 1), by one worker each
        assert got[step]["reward"] == ref[step]["reward"]
        assert got[step]["staleness/max"] == ref[step]["staleness/max"] == step - 1
    assert got[1]["loss"] != 0 and got[1]["loss"] == pytest.approx(ref[1]["loss"], abs=1e-5)
    assert got[1]["sync/probe_abs_diff_mean"] < 1e-4  # the push gathered from both processes


def test_sequence_parallel_data_ranks_and_refusals() -> None:
    view = Dist(rank=3, world_size=4).for_sequence_parallel(2)
    assert (view.rank, view.world_size, view.replicas, view.process) == (1, 2, 2, 3)
    assert not view.is_main and Dist(rank=1, world_size=4).for_sequence_parallel(2).rank == 0
    assert Dist().for_sequence_parallel(1) == Dist()
    with pytest.raises(ValueError, match=r"actor\.sequence_parallel_size=2 must divide"):
        Dist(rank=0, world_size=3).for_sequence_parallel(2)
    # vLLM servers are shared by an sp group too
    # (tests/examples/test_examples_sequence_parallel_servers.py)
    GRPOExampleConfig(
        actor=ActorConfig(sequence_parallel_size=2, lora=LoraConfig(rank=8)),
        rollout=RolloutConfig(max_staleness=1, backend="vllm"),
    )
    # PPO: one sp layout for both engines (an sp group is one data rank of both)
    lora = LoraConfig(rank=8)
    with pytest.raises(ValueError, match=r"critic\.sequence_parallel_size.*actor\.sequence_"):
        PPOExampleConfig(actor=ActorConfig(sequence_parallel_size=2, lora=lora))
    ppo = PPOExampleConfig(
        actor=ActorConfig(sequence_parallel_size=2, lora=lora),
        critic=CriticConfig(sequence_parallel_size=2, lora=lora),
    )
    assert ppo.critic.sequence_parallel_size == 2
