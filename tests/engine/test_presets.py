"""The GPU presets (configs/presets/*.yaml) load through the GRPO recipe's config loader.

Each must be a valid ``GRPOExampleConfig`` (so ``--config`` accepts it), set a Hub model, a
16-bit frozen base under LoRA and a token budget, name its launch command and the memory table,
and the Qwen2.5 ones come in an ``hf`` and a ``vllm`` variant. ``benchmarks/memory_table.py``
computes their memory (docs/gpu.md); here, that it runs on a preset and that the presets fit the
80 GiB GPU the table assumes, and that the mixture-of-experts preset's header states its
estimate as the script computes it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "presets"
FILES = sorted(PRESETS.glob("*.yaml"))
MODELS = ("0.5B", "1.5B", "7B")
GiB = 2**30


def _memory_table():
    path = PRESETS.parents[1] / "benchmarks" / "memory_table.py"
    spec = importlib.util.spec_from_file_location("benchmarks_memory_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_model_has_an_hf_and_a_vllm_preset() -> None:
    names = {f.stem for f in FILES}
    for size in MODELS:
        base = f"qwen2.5-{size.lower()}-instruct"
        assert {base, f"{base}-vllm"} <= names, names


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_preset_loads_into_the_grpo_config(path: Path) -> None:
    cfg = load_config(GRPOExampleConfig, path)
    assert isinstance(cfg, GRPOExampleConfig)
    table = _memory_table()
    assert cfg.model.path in {**table.QWEN25, **table.QWEN25_VL, **table.QWEN3_MOE}  # estimated
    assert cfg.actor.lora.rank > 0 and cfg.actor.base_dtype == "bfloat16"
    assert cfg.actor.micro_batch_size is None and cfg.actor.max_tokens_per_micro_batch > 0
    assert cfg.rollout.backend == ("vllm" if path.stem.endswith("-vllm") else "hf")
    # The toy recipe's one CPU thread would starve a GPU run's host-side work (tokenizing,
    # gathering weights for a sync, checkpoints): torch's default.
    assert cfg.train.num_threads == 0
    text = path.read_text()
    assert f"--config configs/presets/{path.name}" in text
    assert "torchrun --nproc_per_node 8" in text and "docs/gpu.md" in text
    # The 8-GPU overrides the header documents keep the config valid.
    overrides = ["rollout.prompts_per_step=128", "train.mini_batch_size=256"]
    assert overrides[0] in text and overrides[1] in text
    load_config(GRPOExampleConfig, path, overrides)


@pytest.mark.parametrize(
    "name", ["qwen2.5-0.5b-instruct", "qwen2.5-7b-instruct-vllm", "qwen2.5-vl-3b-instruct"]
)
def test_memory_table_estimate_of_a_preset_fits_its_gpu(name: str) -> None:
    table = _memory_table()
    assert {f"Qwen/Qwen2.5-{size}-Instruct" for size in MODELS} == set(table.QWEN25)
    estimate = table.preset_estimate(PRESETS / f"{name}.yaml", 1, 80 * GiB)
    assert (
        estimate.fits
        and estimate.tokens
        == load_config(GRPOExampleConfig, PRESETS / f"{name}.yaml").actor.max_tokens_per_micro_batch
    )
    assert (estimate.vllm > 0) == name.endswith("-vllm")


def test_the_moe_preset_states_its_estimate_and_keeps_the_experts_frozen() -> None:
    """Qwen3-30B-A3B: LoRA on attention only (peft's all-linear would adapt every expert), and
    the header's memory lines are what ``memory_table.py --summary`` prints for it, alone and
    with LoRA on the experts (which needs 8 GPUs): computed, not written by hand."""
    table = _memory_table()
    path = PRESETS / "qwen3-30b-a3b-instruct-2507.yaml"
    cfg = load_config(GRPOExampleConfig, path)
    assert cfg.model.path in table.QWEN3_MOE and cfg.actor.lora.target_parameters is None
    assert cfg.actor.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    header = [line.removeprefix("#").strip() for line in path.read_text().splitlines()]
    experts = "actor.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]"
    assert experts in header
    frozen, adapted = (table.summary(path, overrides) for overrides in ([], [experts]))
    for lines in (frozen.splitlines(), adapted.splitlines()):
        assert "B active per token" in lines[0] and "routing key 768 bytes" in lines[0]
        assert all(line in header for line in lines), lines
    assert "does not fit" not in frozen and "does not fit 80" in adapted.splitlines()[1]
