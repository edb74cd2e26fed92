"""The second GPU session's steps (benchmarks/gpu_check_steps.sh) on a CPU, as far as a CPU goes:
every recipe step's command line resolves to a valid config (a bad key would cost a GPU
session), and recipe-offload's save-and-resume runs for real on a tiny model on the CPU (FSDP2
over a one-rank gloo group, the resume and its check). The CUDA-IPC round trip skips without
CUDA."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from example_utils import TINY_MODEL, TINY_RL

from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import load_config
from microrl.run.cli import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
# The second session's recipe steps with run_recipe recording its command line instead of
# running it (recipe-vision's: tests/benchmarks/test_gpu_check.py).
RECORD = r"""
source benchmarks/gpu_check.sh
init_run
run_recipe() { echo "${RECIPE_SCRIPT:-examples/grpo_lora.py} $*" >>"$CALLS"; }
export -f run_recipe
for step in recipe_offload recipe_ppo recipe_teacher recipe_reward; do
    "step_$step" >/dev/null 2>&1
done
"""


def test_every_recipe_step_resolves_to_a_valid_config(tmp_path) -> None:
    calls = tmp_path / "calls"
    env = {**NO_GPU, "TMPDIR": str(tmp_path), "CALLS": str(calls)}
    env["GPU_CHECK_WHEELS"] = str(tmp_path / "no-wheels")
    subprocess.run(["bash", "-c", RECORD], cwd=ROOT, env=env, check=True, timeout=300)
    lines = calls.read_text().splitlines()
    names = [line.split()[1] for line in lines]
    assert names == [
        "recipe-offload", "recipe-offload", "recipe-ppo", "recipe-teacher", "recipe-reward",
    ], names  # fmt: skip
    for line in lines:
        script, _name, _nproc, *overrides = shlex.split(line)
        schema, yaml = (
            (PPOExampleConfig, "ppo_lora.yaml")
            if script.endswith("ppo_lora.py")
            else (GRPOExampleConfig, "grpo_lora.yaml")
        )
        overrides = [o for o in overrides if o != "--resume"]
        cfg = load_config(schema, CONFIG_DIR / yaml, overrides)  # raises naming a bad key
        assert cfg.train.steps in (2, 4), line
    assert lines[1].endswith("--resume") and "actor.optim.cpu_offload=true" in lines[1]
    assert "teacher.backend=engine" in lines[3] and "rollout.max_staleness=1" in lines[3]
    reward_model = Path(shlex.split(lines[4])[-3].split("=", 1)[1])
    assert (reward_model / "config.json").is_file()  # the step built it before the recipe


# recipe-offload for real, on the CPU and the tests' tiny model: run_recipe's CUDA device
# overridden (later overrides win), the rest of the step as on the GPU.
OFFLOAD = r"""
source benchmarks/gpu_check.sh
init_run
eval "$(declare -f run_recipe | sed '1s/run_recipe/cuda_run_recipe/')"
run_recipe() { cuda_run_recipe "$1" "$2" actor.device=cpu $TINY "${@:3}"; }
export -f run_recipe cuda_run_recipe
step_recipe_offload
echo "rc=$?"
"""


def test_recipe_offload_saves_and_resumes_on_a_cpu(tmp_path) -> None:
    tiny = [*TINY_MODEL, *TINY_RL, "output.log_every=1", "train.num_threads=1"]
    env = {**NO_GPU, "TMPDIR": str(tmp_path), "TINY": " ".join(tiny), "GPU_CHECK_WARM_STEPS": "2"}
    proc = subprocess.run(
        ["bash", "-c", OFFLOAD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout
    assert out.endswith("rc=0\n"), out[-3000:] + proc.stderr[-3000:]
    assert "KEY: resumed: steps 1..4 logged once each" in out


# The benchmark steps with the interpreter recording its command line instead of running it.
BENCH = r"""
source benchmarks/gpu_check.sh
init_run
record() { echo "$*" >>"$CALLS"; }
export -f record
for step in gpu_step_qwen05 gpu_step_qwen15 gpu_step_offload; do
    PYTHON=record "step_$step"
done
"""


def test_the_benchmark_steps_pass_arguments_the_benchmark_accepts(tmp_path) -> None:
    """Each gpu-step-* command, run with ``--dry-run``: valid arguments, and the runs planned
    (0.5B LoRA and full against TRL, 1.5B LoRA, the offload row alone)."""
    calls = tmp_path / "calls"
    env = {**NO_GPU, "TMPDIR": str(tmp_path), "CALLS": str(calls)}
    subprocess.run(["bash", "-c", BENCH], cwd=ROOT, env=env, check=True, timeout=120)
    planned = []
    for line in calls.read_text().splitlines():
        script, *args = shlex.split(line)
        assert script == "benchmarks/bench_gpu_step.py" and "--json" in args, line
        proc = subprocess.run(
            [sys.executable, script, *args, "--dry-run"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        planned.append(proc.stdout.splitlines())
    assert planned == [
        ["microrl lora 0.5b", "trl lora 0.5b", "microrl full 0.5b", "trl full 0.5b"],
        ["microrl lora 1.5b", "trl lora 1.5b"],
        ["microrl offload 0.5b"],
    ]


def test_the_ipc_round_trip_skips_without_cuda() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/ipc_roundtrip.py"],
        cwd=ROOT, env=NO_GPU, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 77, proc.stdout + proc.stderr
    assert proc.stdout == "KEY: no CUDA device: a CUDA IPC handle needs one\n"
