"""Host memory of an asynchronous run's start (``rollout.max_staleness > 0``, ``hf`` worker).

    python benchmarks/bench_start_memory.py            # a 24M-parameter Qwen2-style model, ~1 min

Starts an :class:`~microrl.rollout.samplers.hf_worker.AsyncRollout` (spawn the worker, build its
model, the first full push, its check) over a LoRA and a full fine-tune engine on the CPU, and
reports, in multiples of the model's bytes ``M`` (every tensor in its storage dtype), with the
push's chunks (``microrl.rollout.worker.stream.CHUNK_BYTES``, 256 MiB) scaled down to
``--chunk-mib`` (8 MiB), so that the small model takes several, as a 7B model takes 60:

* **trainer**: the peak of the tensors the trainer allocates during the start
  (``benchmarks/live_bytes.py``), above what it held before;
* **worker**: the worker process's peak resident memory (``VmHWM``) above its resident memory
  once started (``VmRSS``: its libraries and its own copy of the model, which it needs): what the
  start made it hold on top.

On a CPU the trainer's "gathered" tensors are its own parameters (nothing is copied for them);
on a GPU each is a device-to-host copy, which benchmarks/README.md adds in its arithmetic for a
7B model.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import ActorEngine
from microrl.rollout.samplers.hf_worker import AsyncRollout
from microrl.rollout.worker import stream
from microrl.run.toy_model import build_tokenizer

MiB = 2**20


def _live_bytes():
    """benchmarks/live_bytes.py's LiveBytes (this directory is not a package)."""
    path = Path(__file__).with_name("live_bytes.py")
    spec = importlib.util.spec_from_file_location("live_bytes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveBytes


def _status_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (Linux): ``VmRSS`` now, ``VmHWM`` its peak."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def build_engine(lora_rank: int, tokenizer) -> ActorEngine:
    config = Qwen2Config(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    return ActorEngine(model, ActorConfig(lora=LoraConfig(rank=lora_rank), micro_batch_size=8))


def model_bytes(engine: ActorEngine) -> int:
    tensors = [*engine.module.parameters(), *engine.module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(lora_rank: int) -> dict[str, float]:
    tokenizer = build_tokenizer()
    engine = build_engine(lora_rank, tokenizer)
    size = model_bytes(engine)
    gc.collect()
    with _live_bytes()() as live:
        worker = AsyncRollout(engine, tokenizer)
    try:
        pid = worker.process.pid
        hwm, rss = _status_kib(pid, "VmHWM") * 1024, _status_kib(pid, "VmRSS") * 1024
    finally:
        worker.close()
    return {
        "model_mib": size / MiB,
        "trainer_mib": live.peak / MiB,
        "trainer_x": live.peak / size,
        "worker_mib": (hwm - rss) / MiB,
        "worker_x": (hwm - rss) / size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", type=float, default=8.0, help="bytes per push chunk")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stream.CHUNK_BYTES = int(args.chunk_mib * MiB)  # read at each push (the worker is told it)
    print(f"torch {torch.__version__}, push chunks of {args.chunk_mib:g} MiB")
    print("| run | model M | trainer peak above start | worker peak above its model |")
    print("|---|---|---|---|")
    for name, rank in (("LoRA r=8", 8), ("full fine-tune", 0)):
        r = measure(rank)
        print(
            f"| {name} | {r['model_mib']:.0f} MiB | {r['trainer_mib']:.0f} MiB "
            f"({r['trainer_x']:.2f} M) | {r['worker_mib']:.0f} MiB ({r['worker_x']:.2f} M) |"
        )


if __name__ == "__main__":
    main()
