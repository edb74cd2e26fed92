"""The GRPO recipe on the mixture-of-experts toy base (``model.toy_arch=moe``, tiny sizes).

The toy itself is tested in tests/run/test_toy_model.py and tests/run/test_base_model.py, the
engine's MoE path in tests/engine/moe/; here the recipe's use of them: the toy built and
warm-started as a Qwen3-MoE, LoRA on attention and on the fused expert weights, the router's
load-balancing loss and expert loads in the metrics, the adapter exported with the experts'.
"""

from __future__ import annotations

from pathlib import Path

from example_utils import LENGTH_REWARD, TINY_MODEL, TINY_RL, load_example

from microrl.run import read_metrics

MOE = [
    "model.toy_arch=moe",
    "model.num_layers=2",  # two MoE layers: one load metric each
    "actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
    "actor.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]",
    "actor.router_loss.aux_loss_coef=0.01",
]


def test_grpo_trains_lora_on_the_moe_toys_attention_and_experts(tmp_path: Path) -> None:
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig

    base, out = tmp_path / "base", tmp_path / "run"
    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)  # groups differ: the policy moves
    args = [
        f"task.rewards.functions=[{tmp_path / 'length_reward.py'}:length]",
        *TINY_MODEL,
        *TINY_RL,
        *MOE,
        f"model.path={base}",
        f"output.dir={out}",
        "train.steps=2",
        "output.plot=false",
        "output.tensorboard=false",
    ]
    assert load_example("grpo_lora").main(args) == 0
    assert AutoConfig.from_pretrained(base).model_type == "qwen3_moe"
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records[1:]:
        assert record["router/aux_loss"] > 0 and record["grad_norm"] > 0
        for layer in (0, 1):
            low, high = (
                record[f"router/layer{layer}/load_min"],
                record[f"router/layer{layer}/load_max"],
            )
            assert 0 <= low <= 0.25 <= high <= 1  # shares of 4 experts' assignments
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert sorted(adapter["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # Every adapter trained, the experts' too (peft nests the two on one module: base_layer).
    trained = load_file(out / "adapter" / "adapter_model.safetensors")
    ups = {name: bool(t.any()) for name, t in trained.items() if "lora_B" in name}
    assert sum(".mlp.experts." in name for name in ups) == 4 and all(ups.values()), ups
