"""Per-GPU memory of the presets (configs/presets/), computed by microrl.estimate_memory.

    python benchmarks/memory_table.py                  # the markdown table of docs/gpu.md
    python benchmarks/memory_table.py --detail         # and each preset's full breakdown
    python benchmarks/memory_table.py --gpu-memory 141 # another device size, in GiB
    python benchmarks/memory_table.py --summary configs/presets/x.yaml [key=value ...]
                                                       # a preset's header lines

Computed, not measured on a GPU: the architecture numbers below are those of the models'
config.json on the Hugging Face Hub (no download here), and each preset's engine settings come
from its YAML through the recipe's config loader. Rows: 1 GPU, and 8 GPUs under FSDP2 with the
same token budget per micro-batch (the presets' documented 8-GPU overrides). A vision-language
preset's activations include its tower over IMAGE_TOKEN_SHARE of the tokens' image patches. An
``hf`` preset on 8 GPUs also has its sampling phase: the policy gathered whole for ``generate``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import Qwen2_5_VLConfig, Qwen2Config, Qwen3MoeConfig

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


# https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/config.json
QWEN25_VL = {
    "Qwen/Qwen2.5-VL-3B-Instruct": dict(
        text_config=dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=128000,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [16, 24, 24],
            },
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=True,
    ),
}
# https://huggingface.co/Qwen/Qwen3-30B-A3B-Instruct-2507/blob/main/config.json (the shapes of
# Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token)
QWEN3_MOE = {
    "Qwen/Qwen3-30B-A3B-Instruct-2507": dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        vocab_size=151936,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
    ),
}
# Of a vision-language preset's micro-batch tokens, the share assumed to be image placeholders
# (a 448 x 448 image is 256 of them beside a few hundred text tokens).
IMAGE_TOKEN_SHARE = 0.25


def model_config(model_id: str) -> Qwen2Config | Qwen2_5_VLConfig | Qwen3MoeConfig:
    """The transformers config of a Qwen2.5(-VL) or Qwen3-MoE model from its known shapes (no
    download)."""
    if model_id in QWEN25_VL:
        return Qwen2_5_VLConfig(**QWEN25_VL[model_id])
    if model_id in QWEN3_MOE:
        return Qwen3MoeConfig(**QWEN3_MOE[model_id])
    return Qwen2Config(max_position_embeddings=32768, **QWEN25[model_id])


def preset_estimate(
    path: Path, world_size: int, gpu_memory: int, overrides: list[str] | None = None
) -> MemoryEstimate:
    """The estimate for one preset YAML (with ``overrides``, ``key=value`` as on the command
    line) on ``world_size`` GPUs of ``gpu_memory`` bytes."""
    cfg = load_config(GRPOExampleConfig, path, overrides or ())
    vllm = cfg.rollout.vllm.gpu_memory_utilization if cfg.rollout.backend == "vllm" else None
    vlm = cfg.model.path in QWEN25_VL
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
        image_tokens_per_micro_batch=int(cfg.actor.max_tokens_per_micro_batch * IMAGE_TOKEN_SHARE)
        if vlm
        else 0,
    )


def summary(path: Path, overrides: list[str] | None = None, gpu_memory: int = 80 * GiB) -> str:
    """A preset's estimate in two lines for its header comment: parameters (active per token
    for a mixture of experts), trainable, the routing key, the total on 1 and on 8 GPUs."""
    one, eight = (preset_estimate(path, n, gpu_memory, overrides) for n in (1, 8))
    active = ""
    if one.num_active_params != one.num_params:
        active = f" ({one.num_active_params / 1e9:.3g}B active per token)"
    key = one.routing_key_bytes_per_token
    fit = lambda e: "" if e.fits else f", does not fit {gpu_memory / GiB:g}"  # noqa: E731
    return (
        f"{one.num_params / 1e9:.3g}B params{active}, {one.num_trainable / 1e6:.4g}M trainable"
        + (f", routing key {key} bytes per token" if key else "")
        + f"\n1 GPU: {one.total / GiB:.1f} GiB{fit(one)}; 8 GPUs: {eight.total / GiB:.1f} GiB "
        f"each{fit(eight)}{' (hf sampling)' if eight.peak_phase == 'hf sampling' else ''}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    parser.add_argument("--detail", action="store_true", help="each preset's full breakdown")
    parser.add_argument(
        "--summary",
        metavar="PRESET",
        help="only this preset's two-line summary for its header (overrides after it)",
    )
    parser.add_argument("overrides", nargs="*", help="with --summary: key=value overrides")
    args = parser.parse_args()
    gpu_memory = int(args.gpu_memory * GiB)
    if args.summary:
        print(summary(Path(args.summary), args.overrides, gpu_memory))
        return
    gib = lambda n: f"{n / GiB:.1f}"  # noqa: E731
    print(
        "| preset | GPUs | tokens / micro-batch | checkpointing | weights | adapters + grads + "
        "AdamW | activations | forward/backward peak | FSDP gathered | hf generation gathered | "
        "vLLM share | teacher | total GiB "
        f"| fits {args.gpu_memory:g} GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
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
                f"{gib(trained)} | {gib(e.activations + e.vision_activations)} | {gib(e.compute_peak)} | "
                f"{gib(e.fsdp_buffers)} | {gib(e.hf_gathered_weights)} | {gib(e.vllm)} | "
                f"{gib(e.teacher_weights + e.teacher_forward)} | **{gib(e.total)}**"
                f"{' (hf sampling)' if e.peak_phase == 'hf sampling' else ''} | "
                f"{'yes' if e.fits else 'no'} |"
            )
            details.append(f"{path.stem}, {world_size} GPU(s):\n{e}")
    if args.detail:
        print("\n" + "\n\n".join(details))


if __name__ == "__main__":
    main()
