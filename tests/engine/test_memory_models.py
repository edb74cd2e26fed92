"""What ``estimate_memory`` counts beside the trained model's step (engine/memory_models.py): a
``task.reward_model`` (its bytes those of the frozen engine the scorer builds), the policy
gathered whole for ``hf`` generation under FSDP2, and the pixel bytes per image token (those of
the image encoder's own tensors).
"""

from __future__ import annotations

import torch
from engine_utils import tiny_model
from model_reward_utils import save_reward_model
from transformers import AutoConfig
from vlm_utils import IMAGE, picture, toy_vlm

from microrl.configs import ActorConfig, LoraConfig
from microrl.engine import RewardModelEngine
from microrl.engine.memory import estimate_memory
from microrl.rollout.images import ImageEncoder

LORA = ActorConfig(max_tokens_per_micro_batch=256, lora=LoraConfig(rank=4))


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_a_reward_model_is_counted_as_the_scorer_holds_it(tmp_path) -> None:
    """bf16 autocast: the frozen classifier's weights in bf16 and its score head in fp32, to the
    byte; its forward's transient is counted too, and both are in the total."""
    path = save_reward_model(tmp_path / "rm", hidden=64)
    rm_config = AutoConfig.from_pretrained(path)
    policy = tiny_model().config
    actor = ActorConfig(max_tokens_per_micro_batch=256, lora=LoraConfig(rank=4), dtype="bfloat16")
    engine = RewardModelEngine(path, ActorConfig(dtype="bfloat16", device="cpu"), frozen=True)
    without = estimate_memory(policy, actor, device="cpu")
    est = estimate_memory(policy, actor, device="cpu", reward_model_config=rm_config)
    assert est.reward_model_weights == _bytes(engine.module)
    assert {p.dtype for p in engine.module.body.parameters()} == {torch.bfloat16}
    assert est.reward_model_forward > 0
    assert est.total == without.total + est.reward_model_weights + est.reward_model_forward
    # Sharded over 8 ranks, each holds an eighth of it (dim 0 rounded up per tensor).
    eighth = estimate_memory(
        policy, actor, device="cpu", world_size=8, reward_model_config=rm_config
    )
    assert eighth.reward_model_weights < est.reward_model_weights / 7


def test_hf_generation_counts_the_policy_gathered_whole_under_fsdp() -> None:
    """FSDP2 gathers every unit for ``generate`` (bf16 on CUDA): a phase of its own; none on one
    unsharded GPU, nor when vLLM samples."""
    model = tiny_model()
    one = estimate_memory(model.config, LORA, world_size=1)
    eight = estimate_memory(model.config, LORA, world_size=8)
    vllm = estimate_memory(
        model.config, LORA, world_size=8, vllm_gpu_memory_utilization=0.1, device_memory=2**30
    )
    params = sum(p.numel() for p in model.parameters())
    adapters = eight.num_params - params  # LoRA's, gathered too
    assert one.hf_gathered_weights == 0 and vllm.hf_gathered_weights == 0
    assert eight.hf_gathered_weights == 2 * (params + adapters)
    # Sampling: parameters and optimizer state (the gradients freed by the optimizer step) and
    # the gathered model; a model much larger than its micro-batch peaks there.
    sampling = eight.persistent - eight.gradients + eight.hf_gathered_weights
    assert eight.total >= sampling
    deep = tiny_model(num_hidden_layers=16).config  # FSDP2 trains with 2 layers gathered of 16
    big = estimate_memory(deep, LORA, world_size=8, tokens_per_micro_batch=1)
    assert big.peak_phase == "hf sampling"
    assert big.total == big.persistent - big.gradients + big.hf_gathered_weights


def test_bytes_per_image_token_are_the_encoders_pixels() -> None:
    """One image token stands for merge**2 patches of float32 pixels: what the image encoder
    returns per placeholder it expands, and the step's pixels count once per prompt."""
    model, tokenizer, processor = toy_vlm()
    encoder = ImageEncoder(processor, model.config.image_token_id, 2)
    encoded = encoder.encode(tokenizer, [f"look {IMAGE} now"], [[picture(8, 8, 0)]])
    pixels, _ = encoded.images[0]
    tokens = encoded.ids[0].count(model.config.image_token_id)
    est = estimate_memory(model.config, LORA, device="cpu", image_tokens_per_step=3 * tokens)
    assert est.image_token_bytes == pixels.numel() * pixels.element_size() // tokens
    assert est.image_pixels == 3 * pixels.numel() * pixels.element_size()
    text = estimate_memory(tiny_model().config, LORA, device="cpu")
    assert text.image_token_bytes == 0 and text.image_pixels == 0
