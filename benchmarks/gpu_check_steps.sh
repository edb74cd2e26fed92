# shellcheck shell=bash
# The second GPU session's steps (issue 40), sourced by benchmarks/gpu_check.sh, which runs them
# (GPU_CHECK_PLAN=second: first, each within the budget benchmarks/README.md gives it). Each
# prints what it does to its log, ends with "KEY: <figure>" and returns 0 (pass), SKIP_RC (skip)
# or anything else (fail), as gpu_check.sh's own steps do. The helpers are exported by init_run.
#
#   gpu-step-qwen05   bench_gpu_step.py: Qwen2.5-0.5B-shaped GRPO step, LoRA and full fine-tune,
#                     microrl against TRL's GRPOTrainer per phase (64 x 8 x 256 tokens)
#   gpu-step-qwen15   the same, Qwen2.5-1.5B-shaped, LoRA
#   gpu-step-offload  the 0.5B full fine-tune with actor.optim.cpu_offload=true (FSDP2 over a
#                     one-rank cpu:gloo,cuda:nccl group), saved, loaded bit-exact, stepped again
#   recipe-offload    the recipe, full fine-tune with cpu_offload: 2 steps, then --resume to 4
#   recipe-ppo        examples/ppo_lora.py: actor and critic on CUDA
#   recipe-teacher    an engine teacher at a local path, rollout.max_staleness=1 (the teacher
#                     scores in the producer)
#   recipe-reward     a sequence-classification reward model at a local path (task.reward_model)
#   ipc-roundtrip     a CUDA tensor to a second process through microrl's JSON CUDA-IPC handles
#   bench-kernel-7b   bench_kernel.py at Qwen2.5-7B's head only (8192 x 3584 x 152064),
#                     microrl against Liger-Kernel

# bench_step NAME ARGS...: benchmarks/bench_gpu_step.py on CUDA, one warm-up and one timed step
# per run, one (microrl, TRL) pair; its runs' logs in GPU_CHECK_WORK/NAME, its JSON in LOGS.
bench_step() {
    local name=$1
    shift
    "$PYTHON" benchmarks/bench_gpu_step.py --device cuda --steps 1 --pairs 1 \
        --out-dir "$GPU_CHECK_WORK/$name" --json "$LOGS/$name.json" "$@"
}

step_gpu_step_qwen05() {
    bench_step gpu-step-qwen05 --sizes 0.5b --rows lora,full
}

step_gpu_step_qwen15() {
    bench_step gpu-step-qwen15 --sizes 1.5b --rows lora
}

step_gpu_step_offload() {
    # 16 prompts x 8: each step streams the 0.5B weights to the GPU per micro-batch and runs
    # AdamW on the host; a quarter of the rollout keeps the step within its budget.
    bench_step gpu-step-offload --sizes 0.5b --rows offload --prompts 16 --mini-batch 64
}

# quick_recipe NAME OVERRIDE...: run_recipe on 1 GPU, evaluated at step 2 and 4 (train.steps in
# the overrides), on a toy base warm-started for GPU_CHECK_WARM_STEPS (100) steps only, once for
# all these steps: they check that a path runs on CUDA, not how well the toy learns.
quick_recipe() {
    local name=$1
    shift
    run_recipe "$name" 1 model.path="$GPU_CHECK_WORK/base/tiny-adder-quick" \
        model.warm_start.max_steps="${GPU_CHECK_WARM_STEPS:-100}" train.eval_every=2 "$@"
}

# resumed_figure METRICS LOG LAST: checks that a run resumed (its LOG says so) and that
# METRICS logged each step 1..LAST once: nothing lost or repeated across the save.
resumed_figure() {
    "$PYTHON" - "$@" <<'EOF'
import json
import sys
from pathlib import Path

metrics, log, last = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
lines = metrics.read_text().splitlines() if metrics.is_file() else []
steps = [json.loads(line)["step"] for line in lines if line.strip()]
trained = [s for s in steps if s > 0]
resumed = "resumed from" in log.read_text()
if trained != list(range(1, last + 1)) or not resumed:
    sys.exit(f"KEY: steps logged {trained}, resumed: {resumed} (want 1..{last}, resumed)")
print(f"KEY: resumed: steps 1..{last} logged once each")
EOF
}

step_recipe_offload() {
    # A full fine-tune (no adapter-off reference: no KL) with FSDP2's CPU offload; saved at the
    # end of step 2, resumed to step 4 from the checkpoint (parameters, AdamW, RNG, data).
    local full=(actor.lora.rank=0 actor.optim.cpu_offload=true train.kl_metric_every=0)
    full+=(actor.optim.lr=1e-4)
    local out="$GPU_CHECK_WORK/recipe-offload" log="$GPU_CHECK_WORK/recipe-offload-resume.log"
    quick_recipe recipe-offload "${full[@]}" train.steps=2 || return 1
    quick_recipe recipe-offload "${full[@]}" train.steps=4 --resume 2>&1 | tee "$log"
    ((PIPESTATUS[0] == 0)) || return 1
    resumed_figure "$out/metrics.jsonl" "$log" 4
}

step_recipe_ppo() {
    RECIPE_SCRIPT=examples/ppo_lora.py quick_recipe recipe-ppo critic.device=cuda train.steps=4
}

step_recipe_teacher() {
    # On-policy distillation from an engine teacher at a local path (the toy base itself), the
    # sampling a step ahead in a worker, the teacher scoring there (docs/recipes.md#teachers).
    quick_recipe recipe-teacher teacher.path="$GPU_CHECK_WORK/base/tiny-adder-quick" \
        teacher.backend=engine rollout.max_staleness=1 train.steps=4
}

step_recipe_reward() {
    # A 1-layer sequence classifier over the toy tokenizer (the tests' model_reward_utils), its
    # scores standardised per group, as the reward (docs/tasks.md#reward-models).
    local model="$GPU_CHECK_WORK/reward-model"
    PYTHONPATH=tests "$PYTHON" -c '
import sys
from pathlib import Path

from model_reward_utils import save_reward_model

save_reward_model(Path(sys.argv[1]), seed=2)' "$model" || return 1
    quick_recipe recipe-reward task.reward_model.path="$model" task.reward_model.norm=group \
        train.steps=4
}

step_ipc_roundtrip() {
    "$PYTHON" benchmarks/ipc_roundtrip.py
}

step_bench_kernel_7b() {
    # microrl and Liger only: eager's time and memory at this shape are known (bench-kernel).
    bench_kernel 8192x3584x152064 microrl
}
