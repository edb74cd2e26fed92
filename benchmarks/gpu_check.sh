#!/usr/bin/env bash
# The GPU check: everything in microrl that only a CUDA device exercises, in one run that fits a
# short loan of one GPU (all steps together within GPU_CHECK_BUDGET_S, 450 s by default).
#
#   bash benchmarks/gpu_check.sh
#
# Steps, in this order (the ones worth most first, so a slow machine cuts the least useful):
#   setup         microrl importable (`pip install -e .` if not), liger-kernel if pip can get it
#   kernel-cuda   fused_linear_logprob on CUDA tensors (bf16 and fp16 on the native 16-bit matmul
#                 path, bf16 autocast, one LLM-sized head) against the float64 reference
#   main-job      examples/grpo_lora.py on actor.device=cuda with fewer train.steps
#   bench-kernel  benchmarks/bench_kernel.py --device cuda: microrl against eager and, when
#                 liger_kernel imports, Liger-Kernel's Triton fused linear cross-entropy
#   tests-engine  tests/engine/test_engine_train.py: the engines default to device=auto and dtype=auto,
#                 so on this machine they train on CUDA under bf16 autocast
#   tests-cuda    the other test files that mention cuda (whole files: their CUDA branches)
#   sp-flash      Ulysses sequence parallelism on the real flash_attention_2 kernel, when
#                 flash_attn imports: tests/engine/test_sequence_parallel_flash.py -k cuda
#   bench-long    benchmarks/bench_long.py --device cuda --only offload: activation offload's
#                 pinned copies on a side stream, peak device memory and time of a 16k-token
#                 micro-batch with and without it, gradient checkpointing off and on
#   tests-vllm    tests/rollout/test_rollout_vllm.py (vLLM rollout, weight sync, scoring), when vllm imports
# Each step runs under its own `timeout`, a failing step does not stop the next, and the run ends
# with one table (step, status, seconds, key figure); the exit status is 1 if any step failed.
# Without a CUDA device (or without torch) it prints one line starting "no CUDA device" and
# exits 0, so CPU machines and CI can call it.
#
# Environment (all optional):
#   PYTHON              the interpreter (default: python3, else python)
#   GPU_CHECK_BUDGET_S  seconds for all steps together (default 450: done within 8 minutes)
#   GPU_CHECK_LOGS      folder for each step's log and summary.md (default: a new temp folder)
#   GPU_CHECK_WHEELS    folder of wheels for an offline install (default: .whl/ when it exists);
#                       pip then installs from it alone (--no-index)
#   GPU_CHECK_STEPS     train.steps of the main job (default 50)
#
# Sourcing this file defines the functions without running anything (the tests use that).

set -uo pipefail # no -e: a failing step is recorded and the next one runs

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$(command -v python3 || command -v python || echo python3)}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
# A step that would get less than this is skipped: no step does anything useful in less.
MIN_STEP_S=20
# Exit code a step uses for "nothing to do here" (automake's convention).
SKIP_RC=77
# bench_kernel.py shapes, NxHxV: Qwen2.5-7B's head (H 3584, V 152064) on 8192 tokens, and a
# 32k vocabulary on 16384 tokens.
BENCH_CASES=8192x3584x152064,16384x2048x32768

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

# ---------------------------------------------------------------------------------------------
# Steps: each prints what it does to its log, ends with a line "KEY: <figure>" (else the log's
# last line is the figure) and returns 0 (pass), SKIP_RC (skip) or anything else (fail).

step_setup() {
    if [[ -n ${GPU_CHECK_WHEELS:-} ]] && compgen -G "$GPU_CHECK_WHEELS/*.whl" >/dev/null; then
        # Wheels carried to a machine without a registry (tensordict, pyvers, omegaconf,
        # liger-kernel, ...): installed as they are, their dependencies being the machine's.
        pip_install --no-deps "$GPU_CHECK_WHEELS"/*.whl || return 1
    fi
    if ! "$PYTHON" -c 'import microrl.engine, microrl.kernels' 2>/dev/null; then
        echo "microrl is not importable: installing it (editable)"
        # Without a registry (or wheels for every dependency) a full install fails: then install
        # microrl alone, which is enough when the machine already has its dependencies.
        pip_install -e . || pip_install --no-build-isolation --no-deps -e . || return 1
        "$PYTHON" -c 'import microrl.engine, microrl.kernels' || return 1
    fi
    if ! "$PYTHON" -c 'import liger_kernel' 2>/dev/null; then
        # A benchmark-only peer: without it the benchmark has no Liger rows, nothing fails.
        # --no-deps: its dependencies are torch and triton, which must stay the machine's own.
        pip_install --no-deps liger-kernel || echo "liger-kernel not installed: no Liger rows"
    fi
    "$PYTHON" - <<'EOF'
import importlib.util

import torch

liger = "liger-kernel" if importlib.util.find_spec("liger_kernel") else "no liger-kernel"
vllm = "vllm" if importlib.util.find_spec("vllm") else "no vllm"
print(f"KEY: torch {torch.__version__}, {liger}, {vllm}")
EOF
}

step_kernel_cuda() {
    # The kernel tests build their tensors on the CPU, where 16-bit inputs are upcast; this runs
    # their cases on CUDA tensors, where bf16/fp16 take the native 16-bit matmul path, with the
    # tolerances of the test that emulates that path (tests/kernels/test_kernel_precision.py).
    "$PYTHON" - <<'EOF'
import sys
import time

import torch

sys.path.insert(0, "tests/kernels")
from kernel_utils import assert_outputs_close, run
from test_kernel_precision import N, make, truth

from microrl.kernels import fused_linear_logprob, linear_logprob

GRAD_ATOL_16 = 2**-7  # the logit gradient is rounded to 16 bits before the weight matmuls
worst = 0.0


def to_cuda(hidden, weight, targets, grads):
    """``make``'s CPU tensors as CUDA leaves."""
    hidden, weight = (t.detach().cuda().requires_grad_() for t in (hidden, weight))
    return hidden, weight, targets.cuda(), grads.cuda()


def check(name, hidden, weight, targets, grads, grad_atol, autocast=False, **kwargs):
    global worst
    want = truth(hidden, weight, targets, grads, **kwargs)
    up = {"grad_lp": grads[0].float(), "grad_ent": grads[1].float()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        got = run(fused_linear_logprob, hidden, weight, targets, **up, **kwargs)
    assert_outputs_close(got, want, values=(1e-4, 0.0), grad_atol=grad_atol, name=name)
    worst = max(worst, (got[0].double() - want[0]).abs().max().item())
    print(f"ok {name}")


# 1. The precision test's case (logits up to ~30, where a bf16 ulp is 0.125) on CUDA.
per_token = torch.rand(N, generator=torch.Generator().manual_seed(2)).cuda() + 0.5
for dtype in (torch.bfloat16, torch.float16):
    hidden, weight, targets, grads = to_cuda(*make(dtype))
    assert linear_logprob._use_native16(hidden, weight), f"{dtype}: no native 16-bit matmul"
    for temperature in (1.0, 0.6, per_token):
        for chunk_size in (16, None):  # weight gradient summed over 3 row chunks, or the default
            name = f"{dtype} T={'per-token' if torch.is_tensor(temperature) else temperature}"
            check(
                f"{name} chunk={chunk_size}", hidden, weight, targets, grads, GRAD_ATOL_16,
                temperature=temperature, chunk_size=chunk_size,
            )  # fmt: skip

# 2. bf16 activations and a float32 weight under bf16 autocast, as the engine runs: the head
#    still computes in float32 (a float32 matmul on CUDA), backward included.
hidden, weight, targets, grads = to_cuda(*make(torch.bfloat16, torch.float32))
check("autocast bf16/fp32", hidden, weight, targets, grads, 1e-5, autocast=True)

# 3. An LLM-sized head with the default plan: several row chunks and vocabulary tiles.
n, h, v = 4096, 2048, 32768
g = torch.Generator(device="cuda").manual_seed(0)
hidden = torch.randn(n, h, generator=g, device="cuda").bfloat16().requires_grad_()
weight = (torch.randn(v, h, generator=g, device="cuda") * 2 * h**-0.5).bfloat16()
targets = torch.randint(0, v, (n,), generator=g, device="cuda")
grads = torch.randn(2, n, generator=g, device="cuda", dtype=torch.float64)
check(f"{n}x{h}x{v} bf16", hidden, weight.requires_grad_(), targets, grads, GRAD_ATOL_16)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(5):
    run(fused_linear_logprob, hidden, weight, targets, grad_lp=grads[0].float())
torch.cuda.synchronize()
ms = (time.perf_counter() - start) / 5 * 1e3
print(f"KEY: within tolerance of float64, max |dlogprob| {worst:.1e}; {n}x{h}x{v} {ms:.0f} ms/step")
EOF
}

step_tests_engine() {
    run_pytest tests/engine/test_engine_train.py
}

step_bench_kernel() {
    local impls=eager,microrl json="$GPU_CHECK_WORK/bench_kernel.json"
    if "$PYTHON" -c 'import liger_kernel' 2>/dev/null; then
        impls+=,liger
    fi
    # One round of 10 timed steps per implementation: the GPU is not shared, so one round is
    # stable, and each round costs a fresh process per implementation and shape.
    "$PYTHON" benchmarks/bench_kernel.py --device cuda --dtypes bfloat16 --impls "$impls" \
        --cases "$BENCH_CASES" --reps 10 --rounds 1 --timeout 120 --json "$json" || return 1
    "$PYTHON" - "$json" <<'EOF'
import json
import statistics
import sys

with open(sys.argv[1]) as f:
    results = json.load(f)
figures, failed = [], False
for case, per in results.items():
    shape = case.split(":")[0]
    mine, liger = per["microrl"], per.get("liger")
    if not mine["times"]:
        figures.append(f"{shape}: microrl failed ({mine.get('error')})")
        failed = True
        continue
    if liger is not None and not liger["times"]:
        figures.append(f"{shape}: liger n/a ({str(liger.get('error'))[:80]})")
    peer = "liger" if liger and liger["times"] else "eager"
    other = per[peer]
    if not other["times"]:
        continue
    time_ratio = statistics.median(mine["times"]) / statistics.median(other["times"])
    # Extra peak memory can be ~0 for a kernel that keeps nothing: guard the division.
    mem_ratio = mine["extra_bytes"] / max(other["extra_bytes"], 1)
    figures.append(
        f"{shape} microrl/{peer}: time {time_ratio:.2f}x, extra peak memory {mem_ratio:.2f}x"
    )
print("KEY: " + "; ".join(figures))
sys.exit(1 if failed else 0)
EOF
}

step_main_job() {
    local out="$GPU_CHECK_WORK/main-job" rc
    mkdir -p "$out"
    # model.path in the temp folder too: the base model is warm-started there (on CUDA) and
    # nothing is written into the repository.
    "$PYTHON" examples/grpo_lora.py actor.device=cuda train.steps="${GPU_CHECK_STEPS:-50}" \
        output.dir="$out/grpo_lora" model.path="$out/base/tiny-adder" model.build_toy=true \
        output.progress=false output.log_every=5 2>&1 | tee "$out/run.log"
    rc=${PIPESTATUS[0]}
    # "held-out greedy accuracy: 0.318 (step 0) -> 0.386 (step 50) in 30s of RL"
    sed -n 's/^held-out greedy accuracy: /KEY: held-out accuracy /p' "$out/run.log"
    return "$rc"
}

step_tests_cuda() {
    local files=()
    # Whole files: a test's CUDA branch need not carry "cuda" in its name. This checker's own
    # test, the vLLM file and the flash-attention SP file (their own steps) are left out.
    mapfile -t files < <(grep -rl --include='test_*.py' cuda tests |
        grep -v -e '^tests/benchmarks/' -e 'vllm' -e 'test_sequence_parallel_flash' | sort)
    if ((${#files[@]} == 0)); then
        echo "KEY: no test file mentions cuda"
        return "$SKIP_RC"
    fi
    echo "test files that mention cuda: ${files[*]}"
    run_pytest "${files[@]}"
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
    run_pytest tests/engine/test_sequence_parallel_flash.py -k cuda -rs
}

step_bench_long() {
    # Activation offload on CUDA (pinned host copies on a side stream, prefetch in backward): the
    # allocator's peak and the time of one 16384-token micro-batch with and without it (its key
    # line: "offload at 16384 tokens: checkpointing off: A -> B MiB, time Rx; ..."). The CPU run
    # of the same script models these device bytes (benchmarks/README.md, "Long sequences").
    "$PYTHON" benchmarks/bench_long.py --device cuda --only offload --lengths 16384 \
        --hidden 1024 --layers 8 --heads 16 --kv-heads 8 --vocab 32768 --reps 3
}

step_tests_vllm() {
    if ! "$PYTHON" -c 'import vllm' >/dev/null 2>&1; then
        echo "KEY: vllm is not installed here (pip install -e '.[vllm]')"
        return "$SKIP_RC"
    fi
    run_pytest tests/rollout/test_rollout_vllm.py
}

# ---------------------------------------------------------------------------------------------
# The runner.

# Prints the CUDA device's name; fails without torch or a device (124 when torch hangs).
cuda_device_name() {
    timeout 120 "$PYTHON" -c '
import torch
assert torch.cuda.is_available()
print(torch.cuda.get_device_name())' 2>/dev/null
}

# The temp and log folders, and what the steps' child shells need.
init_run() {
    GPU_CHECK_WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
    LOGS=${GPU_CHECK_LOGS:-$GPU_CHECK_WORK/logs}
    mkdir -p "$LOGS"
    if [[ -z ${GPU_CHECK_WHEELS:-} && -d "$REPO_ROOT/.whl" ]]; then
        GPU_CHECK_WHEELS="$REPO_ROOT/.whl"
    fi
    export PYTHON GPU_CHECK_WORK GPU_CHECK_WHEELS SKIP_RC BENCH_CASES
    export PYTHONUNBUFFERED=1 # a step stopped by its timeout still leaves its output in the log
    export -f pip_install run_pytest
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
        *) record "$name" fail $((SECONDS - start)) "exit $rc: ${key:0:150}" ;;
    esac
    if ((rc != 0 && rc != SKIP_RC)); then
        echo "   last lines of $log:"
        tail -n 25 "$log" | sed 's/^/   | /'
    fi
}

# Records NAME as skipped because an earlier step it needs did not pass.
skip_step() {
    record "$1" skip 0 "$2"
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

# 1 if any step failed, else 0.
overall_status() {
    local status
    for status in "${STEP_STATUS[@]}"; do
        [[ $status == fail ]] && return 1
    done
    return 0
}

main() {
    cd "$REPO_ROOT" || exit 1
    local rc
    GPU_NAME=$(cuda_device_name)
    rc=$?
    if ((rc == 124)); then
        echo "torch did not answer whether CUDA is available within 120 s"
        exit 1
    elif ((rc != 0)); then
        echo "no CUDA device (torch missing or torch.cuda.is_available() false): nothing to check"
        exit 0
    fi
    init_run
    echo "GPU check on $GPU_NAME with $PYTHON, budget $BUDGET_S s"

    run_step setup 180 step_setup
    local later=(kernel-cuda main-job bench-kernel tests-engine tests-cuda sp-flash bench-long tests-vllm)
    local name
    if [[ ${STEP_STATUS[0]} != pass ]]; then
        # Every later step imports microrl: skip them rather than fail each the same way.
        for name in "${later[@]}"; do skip_step "$name" "needs setup"; done
    else
        run_step kernel-cuda 90 step_kernel_cuda
        run_step main-job 240 step_main_job
        run_step bench-kernel 180 step_bench_kernel
        run_step tests-engine 150 step_tests_engine
        run_step tests-cuda 120 step_tests_cuda
        run_step sp-flash 90 step_sp_flash
        run_step bench-long 150 step_bench_long
        run_step tests-vllm 180 step_tests_vllm
    fi
    print_summary
    overall_status
    exit $?
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
