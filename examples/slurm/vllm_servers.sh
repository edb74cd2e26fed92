#!/bin/bash
# vLLM servers for microrl's trainers on one node: one `vllm serve` per GPU, each on its own GPU
# and port. examples/slurm/grpo_lora.sbatch runs it on every server node (srun, one task per
# node) when VLLM_NODES > 0; it runs until the job step is stopped. The arguments are the ones
# microrl gives its own servers for a LoRA run (docs/async.md#vllm-servers).
#
# From the environment: MODEL (the trainers' model.path), GPUS_PER_NODE, VLLM_PORT, LORA_RANK,
# MAX_MODEL_LEN, OUTPUT_DIR (the logs go to OUTPUT_DIR/vllm/), VLLM_API_KEY (vLLM reads it).
set -euo pipefail
: "${MODEL:?}" "${GPUS_PER_NODE:?}" "${VLLM_PORT:?}" "${LORA_RANK:?}" "${MAX_MODEL_LEN:?}"
: "${OUTPUT_DIR:?}" "${VLLM_API_KEY:?the servers API key (the trainers send the same)}"

# EDIT: this node's address on the private network the trainers reach (never a public one:
# vLLM's API key does not guard its weight-update routes; docs/async.md#vllm-servers).
HOST=${SLURMD_NODENAME:-$(hostname)}
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True  # /v1/load_lora_adapter: a new adapter every sync
mkdir -p "$OUTPUT_DIR/vllm"

for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
    # --skip-tokenizer-init --enable-scale-out: token ids in and out (/inference/v1/generate);
    # --logprobs-mode processed_logprobs: the sampled tokens' log-probs at the temperature;
    # --generation-config vllm: microrl's sampling parameters only, not the model's defaults.
    CUDA_VISIBLE_DEVICES=$gpu vllm serve "$MODEL" \
        --host "$HOST" --port $((VLLM_PORT + gpu)) \
        --skip-tokenizer-init --enable-scale-out \
        --logprobs-mode processed_logprobs --generation-config vllm \
        --dtype bfloat16 --max-model-len "$MAX_MODEL_LEN" \
        --enable-lora --max-lora-rank "$LORA_RANK" --max-loras 4 \
        >"$OUTPUT_DIR/vllm/$HOST-gpu$gpu.log" 2>&1 &
done
wait  # until every server exits (the trainers' job step ends this one)
