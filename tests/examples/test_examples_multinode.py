"""The GRPO recipe on two nodes: two torchrun agents on this machine, one c10d rendezvous.

Each "node" is ``torchrun --nnodes 2 --nproc_per_node 1 --rdzv-backend c10d`` of
examples/grpo_lora.py, so its one process has ``LOCAL_RANK`` 0 and a global ``RANK`` of 0 or 1
(c10d numbers the agents in the order they join: ``--node_rank`` is ignored, so the test never
assumes which invocation is rank 1). On gloo they must train like ``torchrun --nproc_per_node 2``
of the same config on one node (docs/distributed.md#several-nodes).

What a real second node does *not* share with the first, its own disk, is modelled by a
relative path and a working directory of each node's own: a node that does not see
``output.dir`` or ``model.path`` as rank 0 does stops every node at start with one error naming
the key, instead of writing its share of a checkpoint to its own disk or waiting in a collective.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from distributed_utils import free_port
from example_utils import LENGTH_REWARD, TINY_MODEL, TINY_RL
from safetensors.torch import load_file

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.run import Dist, prepare_base_model, read_metrics
from microrl.run.cli import CONFIG_DIR

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GRPO = ROOT / "examples" / "grpo_lora.py"
TIMINGS = ("tokens_per_s", "step_time")
# Each output line of a worker, tagged by torchrun with its global and local rank.
PREFIX = "[rank${rank} local${local_rank}] "
# Same processes, same thread count (train.num_threads=1), same gloo world of 2 on loopback: the
# two launches run the same float32 operations and sum the same two operands in each all-reduce,
# so the metrics agree to the last bit; this bound only absorbs float32 rounding, should gloo
# ever reduce in another order, and is far below what one other prompt or sample would change
# (a reward moves by 1/8 per row, a loss by ~1e-2).
RTOL = 1e-6


@pytest.fixture(scope="module")
def run_args(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The tiny GRPO run of the recipe tests, 2 steps, with a reward that differs within every
    group (the response's length), so that losses and gradients are not zero; its base model
    warm-started once, here, in this process."""
    root = tmp_path_factory.mktemp("multinode")
    (root / "length_reward.py").write_text(LENGTH_REWARD)
    args = [
        *TINY_MODEL,
        *TINY_RL,
        f"model.path={root / 'base'}",
        f"task.rewards.functions=[{root / 'length_reward.py'}:length]",
        "output.plot=false",
        "output.tensorboard=false",
        "train.steps=2",
    ]
    cfg = load_config(GRPOExampleConfig, CONFIG_DIR / "grpo_lora.yaml", args)
    prepare_base_model(cfg.model, cfg.task, Dist(), cfg.rollout.max_new_tokens, lambda *_: None)
    return args


def _environment() -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONUNBUFFERED="1",
        TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=PREFIX,
    )


def _one_node(args: list[str], timeout: float = 240) -> str:
    """``torchrun --nproc_per_node 2`` of the recipe: its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*cmd, str(GRPO), *args], capture_output=True, text=True, timeout=timeout,
        env=_environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _two_nodes(args: list[str], cwds: tuple[Path, Path], logs: Path, timeout: float = 240):
    """Two torchrun agents of one process each, joined by a c10d rendezvous on a free local
    port, started together, node ``n`` in ``cwds[n]``: each node's exit code and output.

    Both must finish within ``timeout``; otherwise both are stopped (SIGTERM: torchrun stops its
    workers, then SIGKILL) and the test fails with both logs."""
    port, rdzv_id = free_port(), f"microrl-test-{uuid.uuid4().hex[:12]}"
    procs = []
    for node, cwd in enumerate(cwds):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", rdzv_id, "--tee", "3",
            str(GRPO), *args,
        ]  # fmt: skip
        log = open(logs / f"node{node}.log", "w+")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=_environment(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        procs.append((proc, log))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    timed_out = [n for n, (p, _) in enumerate(procs) if p.poll() is None]
    for proc, _ in procs:
        _stop(proc)
    outputs = []
    for proc, log in procs:
        log.seek(0)
        outputs.append((proc.returncode, log.read()))
        log.close()
    if timed_out:
        pytest.fail(f"nodes {timed_out} still ran after {timeout} s:\n{_both(outputs)}")
    return outputs


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _both(outputs) -> str:
    return "\n".join(
        f"--- node {n} (exit code {code}) ---\n{out[-4000:]}"
        for n, (code, out) in enumerate(outputs)
    )


def _assert_close_metrics(ref: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [0, 1, 2]
    for want, have in zip(ref, got, strict=True):
        assert want.keys() == have.keys(), (want.keys(), have.keys())
        for key, value in want.items():
            if key not in TIMINGS:
                assert have[key] == pytest.approx(value, rel=RTOL, abs=RTOL), (want["step"], key)


def test_grpo_on_two_nodes_trains_like_two_processes_on_one(run_args, tmp_path: Path) -> None:
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    output = _one_node([*run_args, f"output.dir={one}"])
    assert output.count("held-out greedy accuracy:") == 1
    outputs = _two_nodes([*run_args, f"output.dir={two}"], (ROOT, ROOT), tmp_path)
    assert all(code == 0 for code, _ in outputs), _both(outputs)

    ref, got = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert got[1]["loss"] != 0 and got[1]["grad_norm"] > 0  # the comparison can fail
    _assert_close_metrics(ref, got)  # reward, loss, grad norm, entropy, eval/accuracy, ...

    # One writer over both nodes: global rank 0 (LOCAL_RANK 0 on both nodes is no "main").
    logs = [out for _, out in outputs]
    assert sum(log.count("held-out greedy accuracy:") for log in logs) == 1
    assert sum("[rank0 local0] held-out greedy accuracy:" in log for log in logs) == 1
    # Each rank drew its own rank's streams (prompts: Python's RNG, samples and shuffles:
    # torch's), on the node that had that RANK: the same states as the one-node run's ranks.
    states = {}
    for run in (one, two):
        for rank in (0, 1):
            path = run / "checkpoint" / f"loop_state_rank{rank}.pt"
            states[run, rank] = torch.load(path, weights_only=True)
    for rank in (0, 1):
        assert states[two, rank]["python_rng"] == states[one, rank]["python_rng"], rank
        assert torch.equal(states[two, rank]["torch_rng"], states[one, rank]["torch_rng"]), rank
    assert states[two, 0]["python_rng"] != states[two, 1]["python_rng"]  # two streams
    # The same trained adapter (gathered from both nodes' shards by rank 0).
    want = load_file(one / "adapter" / "adapter_model.safetensors")
    have = load_file(two / "adapter" / "adapter_model.safetensors")
    assert want.keys() == have.keys()
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=RTOL, atol=RTOL, msg=name)


def test_a_node_that_does_not_see_output_dir_stops_every_node(run_args, tmp_path: Path) -> None:
    """``output.dir=out``, relative, names another directory on each node (its own disk): every
    rank writes its share of the checkpoint there, so the run stops at start, on both nodes."""
    cwds = (tmp_path / "node0", tmp_path / "node1")
    for cwd in cwds:
        cwd.mkdir()
    outputs = _two_nodes([*run_args, "output.dir=out"], cwds, tmp_path)
    for code, out in outputs:
        assert code != 0, _both(outputs)
        assert "output.dir=out is not the same directory on every process" in out, _both(outputs)
        assert "docs/distributed.md#several-nodes" in out
    assert not any((cwd / "out" / "metrics.jsonl").exists() for cwd in cwds)


def test_a_node_without_the_base_model_stops_every_node(run_args, tmp_path: Path) -> None:
    """``model.path=base``, relative: a checkpoint on one node's disk only. Without the check,
    the other node would warm-start a toy model of its own (``model.build_toy``) while the first
    went on to train: their collectives would no longer pair."""
    cwds = (tmp_path / "node0", tmp_path / "node1")
    for cwd in cwds:
        cwd.mkdir()
    base = next(a.split("=", 1)[1] for a in run_args if a.startswith("model.path="))
    (cwds[0] / "base").symlink_to(base)
    outputs = _two_nodes(
        [*run_args, "model.path=base", f"output.dir={tmp_path / 'out'}"], cwds, tmp_path
    )
    for code, out in outputs:
        assert code != 0, _both(outputs)
        assert "model.path='base' holds a checkpoint" in out, _both(outputs)
        assert "but not for rank" in out
