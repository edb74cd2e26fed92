"""Per-GPU memory of the Qwen2.5 presets (configs/presets/), computed by microrl.estimate_memory.

    python benchmarks/memory_table.py                  # the markdown table of docs/gpu.md
    python benchmarks/memory_table.py --detail         # and each preset's full breakdown
    python benchmarks/memory_table.py --gpu-memory 141 # another device size, in GiB

Computed, not measured on a GPU: the architecture numbers below are those of the models'
config.json on the Hugging Face Hub (no download here), and each preset's engine settings come
from its YAML through the recipe's config loader. Rows: 1 GPU, and 8 GPUs under FSDP2 with the
same token budget per micro-batch (the presets' documented 8-GPU overrides).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import Qwen2Config

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.engine.memory import GiB, MemoryEstimate, estimate_memory

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "presets"

# https://huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct/blob/main/config.json
QWEN25 = {
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def model_config(model_id: str) -> Qwen2Config:
    """The transformers config of a Qwen2.5 model from its known shapes (no download)."""
    return Qwen2Config(max_position_embeddings=32768, **QWEN25[model_id])


def preset_estimate(path: Path, world_size: int, gpu_memory: int) -> MemoryEstimate:
    """The estimate for one preset YAML on ``world_size`` GPUs of ``gpu_memory`` bytes."""
    cfg = load_config(GRPOExampleConfig, path)
    vllm = cfg.rollout.vllm.gpu_memory_utilization if cfg.rollout.backend == "vllm" else None
    return estimate_memory(
        model_config(cfg.model.path),
        cfg.actor,
        world_size=world_size,
        device="cuda",
        vllm_gpu_memory_utilization=vllm,
        device_memory=gpu_memory,
        vllm_sleep_level=cfg.rollout.vllm.sleep_level if vllm else 0,
        # A distillation preset's in-process teacher (teacher.backend=engine).
        teacher_config=model_config(cfg.teacher.path)
        if cfg.teacher.enabled and cfg.teacher.backend == "engine"
        else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    parser.add_argument("--detail", action="store_true", help="each preset's full breakdown")
    args = parser.parse_args()
    gpu_memory = int(args.gpu_memory * GiB)
    gib = lambda n: f"{n / GiB:.1f}"  # noqa: E731
    print(
        "| preset | GPUs | tokens / micro-batch | checkpointing | weights | adapters + grads + "
        "AdamW | activations | forward/backward peak | FSDP gathered | vLLM share | teacher "
        "| total GiB "
        f"| fits {args.gpu_memory:g} GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    details = []
    # Model by model, smallest first; the hf variant before the vllm one.
    for path in sorted(
        PRESETS.glob("*.yaml"), key=lambda p: (p.stem.removesuffix("-vllm"), p.stem)
    ):
        cfg = load_config(GRPOExampleConfig, path)
        for world_size in (1, 8):
            e = preset_estimate(path, world_size, gpu_memory)
            trained = e.trainable_params + e.gradients + e.optimizer_state
            print(
                f"| {path.stem} | {world_size} | {e.tokens} | "
                f"{'on' if cfg.actor.gradient_checkpointing else 'off'} | {gib(e.weights)} | "
                f"{gib(trained)} | {gib(e.activations)} | {gib(e.compute_peak)} | "
                f"{gib(e.fsdp_buffers)} | {gib(e.vllm)} | "
                f"{gib(e.teacher_weights + e.teacher_forward)} | **{gib(e.total)}** | "
                f"{'yes' if e.fits else 'no'} |"
            )
            details.append(f"{path.stem}, {world_size} GPU(s):\n{e}")
    if args.detail:
        print("\n" + "\n\n".join(details))


if __name__ == "__main__":
    main()
