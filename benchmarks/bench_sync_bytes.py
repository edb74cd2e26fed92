"""Bytes and time of one LoRA weight sync: the adapter export every vLLM sync runs.

    python benchmarks/bench_sync_bytes.py            # a ~90M-parameter model on this CPU
    python benchmarks/bench_sync_bytes.py --layers 4 --hidden 512

Measured: ``export_peft_adapter`` as it is (the state dict of the parameters that train) against
the baseline in the same run, the same export from the whole model's state dict (what it
gathered before: FSDP2 all-gathers every frozen base tensor too, on every sync); and the
adapter file it writes (which every vLLM then reads) in float32 (before) and in a bf16 server's
LoRA dtype (now). Computed for the Qwen2.5 presets (configs/presets/, bf16 base, LoRA rank 32
on every linear layer): the bytes each gathers and writes per sync, from
``microrl.estimate_memory``'s parameter counts (exact to the byte).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import ActorEngine
from microrl.engine.checkpoint import export

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_table import PRESETS, preset_estimate


def gathered_bytes(run) -> tuple[int, float]:
    """The bytes the state-dict gathers inside ``run()`` return, and its seconds."""
    total, real = [0], export.get_model_state_dict

    def spy(model, *args, **kwargs):
        state = real(model, *args, **kwargs)
        total[0] += sum(v.numel() * v.element_size() for v in state.values())
        return state

    export.get_model_state_dict = spy
    try:
        start = time.perf_counter()
        run()
        return total[0], time.perf_counter() - start
    finally:
        export.get_model_state_dict = real


def measure(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules="all-linear")
    engine = ActorEngine(Qwen2ForCausalLM(config), ActorConfig(lora=lora))
    params = sum(p.numel() for p in engine.module.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        adapter_only = lambda: export.export_peft_adapter(  # noqa: E731
            engine.module, Path(tmp) / "adapter", peft_model=engine.peft_model
        )

        def whole_model() -> None:  # the baseline: the same export from every tensor
            real = export.full_state_dict
            export.full_state_dict = lambda model, trainable_only=False: real(model)
            try:
                adapter_only()
            finally:
                export.full_state_dict = real

        runs = {"adapter (now)": [], "whole model (before)": []}
        for _ in range(args.reps):
            runs["adapter (now)"].append(gathered_bytes(adapter_only))
            runs["whole model (before)"].append(gathered_bytes(whole_model))
    print(f"measured: {params / 1e6:.0f}M parameters, LoRA rank {args.rank}, {args.reps} reps")
    print("| export | bytes gathered | seconds (median) |\n|---|---|---|")
    for name, results in runs.items():
        seconds = statistics.median(s for _, s in results)
        print(f"| {name} | {results[0][0] / 2**20:.1f} MiB | {seconds:.3f} |")
    new, old = (statistics.median(s for _, s in r) for r in runs.values())
    print(f"time ratio now/before: {new / old:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        written = {}
        for dtype in (torch.float32, torch.bfloat16):  # before; now for a bf16 server
            path = export.export_peft_adapter(
                engine.module, Path(tmp) / str(dtype), peft_model=engine.peft_model, dtype=dtype
            )
            written[dtype] = (path / "adapter_model.safetensors").stat().st_size
    print(
        f"adapter file per sync: float32 {written[torch.float32] / 2**20:.1f} MiB, bf16 "
        f"{written[torch.bfloat16] / 2**20:.1f} MiB "
        f"({written[torch.bfloat16] / written[torch.float32]:.3f}x)"
    )


def computed() -> None:
    print("\ncomputed for the presets (bf16 base), bytes one LoRA sync gathers:")
    print("| preset | before (whole model) | now (adapter) | ratio |\n|---|---|---|---|")
    presets = sorted(PRESETS.glob("qwen2.5-*-instruct.yaml"))
    estimates = [preset_estimate(p, world_size=1, gpu_memory=80 * 2**30) for p in presets]
    for path, estimate in zip(presets, estimates, strict=True):
        before = estimate.weights + estimate.trainable_params
        now = estimate.trainable_params
        print(
            f"| {path.stem} | {before / 2**30:.2f} GiB | {now / 2**20:.0f} MiB | "
            f"{now / before:.4f} |"
        )
    print("\nthe adapter file one sync writes (and each bf16 vLLM reads), tensors only:")
    print("| preset | before (float32) | now (bf16) |\n|---|---|---|")
    for path, estimate in zip(presets, estimates, strict=True):
        fp32 = estimate.trainable_params  # the adapters' float32 bytes
        print(f"| {path.stem} | {fp32 / 1e6:.1f} MB | {fp32 / 2 / 1e6:.1f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure(args)
    computed()


if __name__ == "__main__":
    main()
