"""``microrl.estimate_memory`` against what an engine really holds on the CPU.

Parameters, gradients and optimizer state must match to the byte (the estimate builds the same
model on ``meta``). The forward/backward peak must lie within 30% of the live bytes measured
over one ``forward_backward_batch`` (``benchmarks/live_bytes.py``: every tensor the call
allocates, gradients already allocated), for two token budgets, with and without gradient
checkpointing, LoRA and a full fine-tune, fp32 and bf16 bases, with and without autocast.

The offloads, on the same cases: ``activation_offload`` with every saved tensor offloaded
(``MIN_OFFLOAD_BYTES = 0``) and with the small ones kept (256 KiB), its device peak against
``benchmarks/bench_long.py``'s ``DeviceBytes`` (which models on the CPU what a GPU holds: the host
copies apart, those in flight or fetched back counted) and its host bytes against the copies held
there at once; ``optim.cpu_offload`` in one process (FSDP2 over one rank), its host parameters,
gradients and optimizer state to the byte, its device peak (FSDP2's gathered weights included).
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from transformers import Qwen2Config, Qwen2ForCausalLM

import microrl
from microrl.configs import ActorConfig, CriticConfig, LoraConfig, OptimConfig
from microrl.engine import ActorEngine, CriticEngine, offload
from microrl.engine.memory import MemoryEstimate, estimate_memory


def _benchmark_module(name: str):
    """A module of benchmarks/ (not a package), loaded from its file."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LiveBytes = _benchmark_module("live_bytes").LiveBytes
bench_long = _benchmark_module("bench_long")
ACTIVATION_TOLERANCE = 0.30  # the documented accuracy of the activation model (docs/gpu.md)


def _model_config(vocab: int = 1024, intermediate: int = 352) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=128,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def _batch(rows: int, width: int, vocab: int) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, width, dtype=torch.bool)
    loss_mask = mask.clone()
    loss_mask[:, : width // 2] = False
    return TensorDict(
        input_ids=torch.randint(0, vocab, (rows, width), generator=gen),
        attention_mask=mask,
        loss_mask=loss_mask,
        advantages=torch.randn(rows, width, generator=gen),
        old_logprobs=-torch.rand(rows, width, generator=gen) - 6,
        old_values=torch.randn(rows, width, generator=gen),
        returns=torch.randn(rows, width, generator=gen),
        batch_size=[rows],
    )


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(engine, batch: TensorDict) -> dict[str, int]:
    """Bytes the engine holds after a step, and the live-bytes peak of a forward/backward."""
    engine.train_batch(batch)  # optimizer state exists from here on
    engine.forward_backward_batch(batch)  # and gradients
    params = {id(p): p for p in [*engine.model.parameters(), *engine.module.parameters()]}
    params = list(params.values())
    state = engine.optimizer.state.values()
    held = {
        "weights": _nbytes(p for p in params if not p.requires_grad),
        "trainable_params": _nbytes(p for p in params if p.requires_grad),
        "gradients": _nbytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _nbytes(t for s in state for t in s.values() if torch.is_tensor(t)),
    }
    gc.collect()
    with LiveBytes() as live:
        engine.forward_backward_batch(batch)
    return {**held, "peak": live.peak}


CASES = [  # (lora rank, gradient checkpointing, base dtype, dtype)
    (8, False, "float32", "float32"),
    (8, True, "float32", "float32"),
    (8, False, "bfloat16", "float32"),
    (8, True, "bfloat16", "bfloat16"),
    (0, False, "float32", "bfloat16"),
    (0, True, "float32", "float32"),
]


@pytest.mark.parametrize(("lora", "checkpointing", "base_dtype", "dtype"), CASES)
@pytest.mark.parametrize("rows", [1, 4], ids=["256-tokens", "1024-tokens"])
def test_estimate_matches_the_engine(lora, checkpointing, base_dtype, dtype, rows) -> None:
    model_config, width = _model_config(), 256
    config = ActorConfig(
        max_tokens_per_micro_batch=rows * width,
        lora=LoraConfig(rank=lora),
        gradient_checkpointing=checkpointing,
        base_dtype=base_dtype,
        dtype=dtype,
    )
    torch.manual_seed(0)
    engine = ActorEngine(Qwen2ForCausalLM(model_config), config)
    measured = _measure(engine, _batch(rows, width, model_config.vocab_size))
    estimate = estimate_memory(model_config, config, device="cpu")
    for key in ("weights", "trainable_params", "gradients", "optimizer_state"):
        assert getattr(estimate, key) == measured[key], key
    ratio = estimate.compute_peak / measured["peak"]
    assert abs(ratio - 1) <= ACTIVATION_TOLERANCE, (
        f"forward/backward peak: estimated {estimate.compute_peak / 2**20:.2f} MiB, "
        f"measured {measured['peak'] / 2**20:.2f} MiB (ratio {ratio:.2f})"
    )


def test_critic_estimate_counts_its_value_head_exactly() -> None:
    model_config = _model_config()
    config = CriticConfig(max_tokens_per_micro_batch=512, lora=LoraConfig(rank=4))
    torch.manual_seed(0)
    engine = CriticEngine(Qwen2ForCausalLM(model_config), config)
    measured = _measure(engine, _batch(2, 256, model_config.vocab_size))
    estimate = estimate_memory(model_config, config, device="cpu", value_head=True)
    for key in ("weights", "trainable_params", "gradients", "optimizer_state"):
        assert getattr(estimate, key) == measured[key], key
    assert estimate.head_buffers == 0


def test_sharding_vllm_share_table_and_errors() -> None:
    model_config = _model_config()
    config = ActorConfig(max_tokens_per_micro_batch=1024, lora=LoraConfig(rank=8))
    one = estimate_memory(model_config, config, device="cpu")
    two = estimate_memory(model_config, config, device="cpu", world_size=2)
    # Dim-0 shards: every tensor here has an even first dimension, so exactly half.
    assert two.weights * 2 == one.weights and two.gradients == one.gradients
    assert two.fsdp_buffers > 0 == one.fsdp_buffers
    shared = estimate_memory(
        model_config,
        config,
        device="cpu",
        vllm_gpu_memory_utilization=0.25,
        device_memory=8 * 2**30,
    )
    assert shared.vllm == 2 * 2**30 and shared.total == one.total + shared.vllm
    assert shared.fits is True and one.fits is None
    table = str(shared)
    for label in ("weights", "optimizer state", "activations (1024 tokens)", "vLLM", "total"):
        assert label in table
    assert isinstance(microrl.estimate_memory(model_config, config), MemoryEstimate)
    with pytest.raises(ValueError, match="tokens_per_micro_batch"):
        estimate_memory(model_config, ActorConfig(lora=LoraConfig(rank=8)))
    with pytest.raises(ValueError, match="device_memory"):
        estimate_memory(model_config, config, vllm_gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(model_config, config, world_size=0)


def test_vllm_sleep_mode_holds_its_share_only_while_sampling() -> None:
    """``rollout.vllm.sleep_level``: vLLM's share and the training step no longer add up; the
    device needs the larger of sampling (persistent + share) and training; level 1 keeps vLLM's
    weights (bf16 on CUDA) in host memory."""
    model_config = _model_config()
    config = ActorConfig(max_tokens_per_micro_batch=1024, lora=LoraConfig(rank=8))
    share = dict(vllm_gpu_memory_utilization=0.25, device_memory=8 * 2**30)
    awake = estimate_memory(model_config, config, **share)
    training = awake.total - awake.vllm
    for level in (1, 2):
        asleep = estimate_memory(model_config, config, vllm_sleep_level=level, **share)
        assert asleep.vllm == awake.vllm == 2 * 2**30
        assert asleep.total == max(training, asleep.persistent + asleep.vllm) < awake.total
        assert asleep.peak_phase == "sampling"  # a 2 GiB share against a tiny model's step
        assert "vLLM share (asleep while training)" in str(asleep)
    with torch.device("meta"):
        base = sum(p.numel() for p in Qwen2ForCausalLM(model_config).parameters())
    level1 = estimate_memory(model_config, config, vllm_sleep_level=1, **share)
    assert level1.host_vllm_weights == 2 * base  # vLLM computes in bf16 on CUDA
    assert level1.host_total == awake.host_total + level1.host_vllm_weights
    assert estimate_memory(model_config, config, vllm_sleep_level=2, **share).host_total == 0
    big = ActorConfig(max_tokens_per_micro_batch=2**20, lora=LoraConfig(rank=8))
    assert estimate_memory(model_config, big, vllm_sleep_level=2, **share).peak_phase != "sampling"
    with pytest.raises(ValueError, match="vllm_sleep_level"):
        estimate_memory(model_config, config, vllm_sleep_level=3, **share)


def test_16_bit_base_halves_the_weights_and_keeps_the_trained_state() -> None:
    model_config = _model_config()
    kwargs = {"max_tokens_per_micro_batch": 1024, "lora": LoraConfig(rank=8)}
    full = estimate_memory(model_config, ActorConfig(**kwargs))
    half = estimate_memory(model_config, ActorConfig(base_dtype="bfloat16", **kwargs))
    assert half.weights * 2 == full.weights
    for key in ("trainable_params", "gradients", "optimizer_state"):
        assert getattr(half, key) == getattr(full, key), key


# ------------------------------------------------------------------------------ the offloads
def _local_nbytes(tensors) -> int:
    return _nbytes(t.to_local() if hasattr(t, "to_local") else t for t in tensors)


def _measure_device(engine, batch: TensorDict) -> tuple[dict[str, int], object]:
    """Bytes the engine holds after a step (each tensor's local shard), and a ``DeviceBytes``
    counter of a forward/backward: the device peak with activation offload's copies in flight
    (``peak_in_flight``), the host copies' peak (``host_peak``), FSDP2's gathered weights."""
    engine.train_batch(batch)
    engine.forward_backward_batch(batch)
    params = list({id(p): p for p in engine.module.parameters()}.values())
    state = engine.optimizer.state.values()
    held = {
        "params": _local_nbytes(params),
        "gradients": _local_nbytes(p.grad for p in params if p.grad is not None),
        "optimizer_state": _local_nbytes(
            t for s in state for t in s.values() if torch.is_tensor(t)
        ),
    }
    gc.collect()
    counter = bench_long.DeviceBytes(engine.device)
    with bench_long.modelled_offload(counter), counter:
        engine.forward_backward_batch(batch)
    return held, counter


def _assert_close(estimated: int, measured: int, what: str) -> None:
    if estimated == measured == 0:
        return
    ratio = estimated / max(measured, 1)
    assert abs(ratio - 1) <= ACTIVATION_TOLERANCE, (
        f"{what}: estimated {estimated / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB "
        f"(ratio {ratio:.2f})"
    )


@pytest.mark.parametrize(("lora", "checkpointing", "base_dtype", "dtype"), CASES)
def test_activation_offload_estimate(lora, checkpointing, base_dtype, dtype, monkeypatch) -> None:
    """Device: what stays (tensors under the threshold, what is never saved) and the copies in
    flight; host: the copies, at their most at once (the end of the forward). A 256 KiB
    threshold at 1024 tokens moves the [1024, >= 128] fp32 tensors (and the bf16 ones of the
    MLP) and keeps the LoRA rank's, 1/rms and the logsumexp; test_cpu_offload_estimate offloads
    every saved tensor (threshold 0)."""
    # The engine's and the estimate's threshold.
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 256 << 10)
    model_config, rows, width = _model_config(), 4, 256
    kwargs = dict(
        max_tokens_per_micro_batch=rows * width,
        lora=LoraConfig(rank=lora),
        gradient_checkpointing=checkpointing,
        base_dtype=base_dtype,
        dtype=dtype,
    )
    config = ActorConfig(**kwargs, activation_offload=True)
    torch.manual_seed(0)
    engine = ActorEngine(Qwen2ForCausalLM(model_config), config)
    _, counter = _measure_device(engine, _batch(rows, width, model_config.vocab_size))
    estimate = estimate_memory(model_config, config, device="cpu")
    plain = estimate_memory(model_config, ActorConfig(**kwargs), device="cpu")
    _assert_close(estimate.compute_peak, counter.peak_in_flight, "device peak")
    _assert_close(estimate.host_activations, counter.host_peak, "host copies")
    assert engine.last_offload_stats.bytes > 0 and estimate.host_activations > 0
    assert estimate.activations < plain.activations
    assert estimate.host_total == estimate.host_activations
    assert estimate.persistent == plain.persistent and estimate.host_params == 0


@pytest.fixture
def one_process(monkeypatch):
    """``optim.cpu_offload`` in one process starts a process group of one rank: ended after."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize(
    ("lora", "checkpointing", "base_dtype", "dtype"), [CASES[i] for i in (0, 3, 4, 5)]
)
def test_cpu_offload_estimate(lora, checkpointing, base_dtype, dtype, monkeypatch) -> None:
    """Host: the parameter shards, gradient shards and optimizer state, to the byte; device: no
    parameter or optimizer state, the forward/backward peak with FSDP2's gathered weights. The
    checkpointed cases offload their activations too (both offloads at once)."""
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)
    model_config, rows, width = _model_config(), 4, 256
    kwargs = dict(
        max_tokens_per_micro_batch=rows * width,
        lora=LoraConfig(rank=lora),
        gradient_checkpointing=checkpointing,
        activation_offload=checkpointing,
        base_dtype=base_dtype,
        dtype=dtype,
    )
    config = ActorConfig(**kwargs, optim=OptimConfig(cpu_offload=True))
    torch.manual_seed(0)
    engine = ActorEngine(Qwen2ForCausalLM(model_config), config)
    held, counter = _measure_device(engine, _batch(rows, width, model_config.vocab_size))
    estimate = estimate_memory(model_config, config, device="cpu")
    plain = estimate_memory(model_config, ActorConfig(**kwargs), device="cpu")
    assert estimate.host_params == held["params"] == plain.weights + plain.trainable_params
    assert estimate.host_gradients == held["gradients"]
    assert estimate.host_optimizer_state == held["optimizer_state"] == plain.optimizer_state
    assert estimate.weights == estimate.trainable_params == estimate.optimizer_state == 0
    assert estimate.gradients == plain.gradients  # full size while micro-batches accumulate
    assert estimate.optimizer_transient == 0 and estimate.fsdp_buffers > 0
    _assert_close(estimate.compute_peak + estimate.fsdp_buffers, counter.peak_in_flight, "device")
    _assert_close(estimate.host_activations, counter.host_peak, "host copies")
    host = estimate.host_params + estimate.host_gradients + estimate.host_optimizer_state
    assert estimate.host_total == host + max(estimate.host_activations, plain.optimizer_transient)


def test_offloads_in_the_table_and_over_ranks() -> None:
    model_config = _model_config()
    config = ActorConfig(max_tokens_per_micro_batch=1024, lora=LoraConfig(rank=8))
    both = ActorConfig(
        max_tokens_per_micro_batch=1024,
        lora=LoraConfig(rank=8),
        activation_offload=True,
        optim=OptimConfig(cpu_offload=True),
    )
    # 8192 tokens: the MLP's bf16 activations pass offload's 1 MiB threshold
    plain = estimate_memory(model_config, config, world_size=2, tokens_per_micro_batch=8192)
    off = estimate_memory(model_config, both, world_size=2, tokens_per_micro_batch=8192)
    assert off.host_params == plain.weights + plain.trainable_params  # this rank's shards
    assert off.host_optimizer_state == plain.optimizer_state and off.host_activations > 0
    assert off.total < plain.total and plain.host_total == 0
    table = str(off)
    for label in ("host: parameters", "host: optimizer state", "host: activations", "host: total"):
        assert label in table
    assert "host:" not in str(plain)


# ------------------------------------------------------------------------------ a teacher
@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_teacher_estimate_matches_the_engine_teacher(base_dtype: str, tmp_path) -> None:
    """On-policy distillation's in-process teacher (microrl/run/teacher.py): its weights to the
    byte (stored in the student's base dtype), its no-grad forward within the activation
    model's tolerance of the live bytes of one scoring pass, both added to the total."""
    from microrl.configs.teacher import TeacherConfig
    from microrl.run.teacher import EngineTeacher

    model_config = _model_config()
    Qwen2ForCausalLM(model_config).save_pretrained(tmp_path / "teacher")
    actor = ActorConfig(
        max_tokens_per_micro_batch=1024, lora=LoraConfig(rank=8), base_dtype=base_dtype
    )
    alone = estimate_memory(model_config, actor)
    with_teacher = estimate_memory(model_config, actor, teacher_config=model_config)
    teacher = EngineTeacher(TeacherConfig(path=str(tmp_path / "teacher")), actor)
    assert with_teacher.teacher_weights == _nbytes(teacher.engine.module.parameters())
    assert with_teacher.total == alone.total + with_teacher.teacher_weights + (
        with_teacher.teacher_forward
    )
    assert "teacher weights (frozen)" in str(with_teacher)
    batch = _batch(4, 256, model_config.vocab_size)
    gc.collect()
    with LiveBytes() as live:
        teacher.score(batch)
    assert abs(with_teacher.teacher_forward - live.peak) <= ACTIVATION_TOLERANCE * live.peak, (
        with_teacher.teacher_forward,
        live.peak,
    )
    sharded = estimate_memory(model_config, actor, teacher_config=model_config, world_size=2)
    assert sharded.teacher_weights == pytest.approx(with_teacher.teacher_weights / 2, rel=0.01)


@pytest.mark.parametrize("lora", [8, 0], ids=["lora", "full"])
@pytest.mark.parametrize("freeze", [True, False], ids=["frozen-tower", "trained-tower"])
def test_vision_language_estimate_counts_the_tower(lora: int, freeze: bool) -> None:
    """A Qwen2.5-VL's tower: its parameters, adapters and optimizer state to the byte, frozen or
    trained, and its activations (none kept when frozen) within the activation model's
    tolerance of the measured peak."""
    from vision_utils import DEFAULT_ROWS, make_image_batch, tiny_vlm

    model = tiny_vlm("qwen2_5_vl")
    batch = make_image_batch(DEFAULT_ROWS * 4)
    config = ActorConfig(
        max_tokens_per_micro_batch=batch["input_ids"].numel(),  # one micro-batch
        lora=LoraConfig(rank=lora),
        freeze_vision=freeze,
    )
    image_tokens = int((batch["input_ids"] == model.config.image_token_id).sum())
    measured = _measure(ActorEngine(model, config), batch)
    estimate = estimate_memory(
        model.config, config, device="cpu", image_tokens_per_micro_batch=image_tokens
    )
    for key in ("weights", "trainable_params", "gradients", "optimizer_state"):
        assert getattr(estimate, key) == measured[key], key
    assert (estimate.vision_activations == 0) == freeze
    ratio = estimate.compute_peak / measured["peak"]
    assert abs(ratio - 1) <= ACTIVATION_TOLERANCE, f"ratio {ratio:.2f}"


def test_image_tokens_need_a_vision_language_config() -> None:
    with pytest.raises(ValueError, match="image_tokens_per_micro_batch needs a vision-language"):
        estimate_memory(_model_config(), ActorConfig(max_tokens_per_micro_batch=64),
                        image_tokens_per_micro_batch=8)  # fmt: skip


def _moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=128,
        intermediate_size=352,
        moe_intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize("lora", [8, 0], ids=["lora-on-experts", "full"])
def test_moe_estimate_counts_experts_and_matches_the_engine(lora: int) -> None:
    """A mixture of experts: parameters to the byte, the peak within the activation model's
    tolerance (k experts' MLP activations per token), the parameters one token uses (2 of 8
    experts per layer) and the routing key's bytes per token (2 layers x top-2, int16)."""
    from transformers import Qwen3MoeForCausalLM

    model_config = _moe_config()
    experts = ["experts.gate_up_proj", "experts.down_proj"] if lora else None
    config = ActorConfig(
        max_tokens_per_micro_batch=512, lora=LoraConfig(rank=lora, target_parameters=experts)
    )
    torch.manual_seed(0)
    engine = ActorEngine(Qwen3MoeForCausalLM(model_config), config)
    measured = _measure(engine, _batch(2, 256, model_config.vocab_size))
    estimate = estimate_memory(model_config, config, device="cpu")
    for key in ("weights", "trainable_params", "gradients", "optimizer_state"):
        assert getattr(estimate, key) == measured[key], key
    ratio = estimate.compute_peak / measured["peak"]
    assert abs(ratio - 1) <= ACTIVATION_TOLERANCE, ratio
    expert_numel = 2 * 8 * (2 * 96 * 128 + 128 * 96)  # layers x experts x (gate_up + down)
    assert estimate.num_params - estimate.num_active_params == expert_numel * 6 // 8
    assert estimate.routing_key_bytes_per_token == 2 * 2 * 2
    assert "active per token" in str(estimate) and "8 bytes per token" in str(estimate)
    dense = estimate_memory(_model_config(), ActorConfig(max_tokens_per_micro_batch=512))
    assert dense.num_active_params == dense.num_params and dense.routing_key_bytes_per_token == 0


def test_moe_estimate_builds_the_expert_adapters_on_meta(monkeypatch) -> None:
    """peft builds the adapters of ``target_parameters`` on the default device (then moves them
    to the base's): the estimate builds them on ``meta`` from the start, or a large MoE's (1.3B
    parameters for Qwen3-30B-A3B at rank 32) would be allocated and initialised on the host for
    a count."""
    from microrl.engine.memory_params import meta_model

    initialised = []
    kaiming = torch.nn.init.kaiming_uniform_

    def record(tensor, *args, **kwargs):
        initialised.append(tensor.device.type)
        return kaiming(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", record)
    experts = ["experts.gate_up_proj", "experts.down_proj"]
    config = ActorConfig(lora=LoraConfig(rank=8, target_parameters=experts))
    model = meta_model(_moe_config(), config, value_head=False)
    adapters = [n for n, _ in model.named_parameters() if ".experts." in n and "lora_" in n]
    assert len(adapters) == 2 * 4  # layers x (gate_up, down) x (A, B)
    assert initialised and set(initialised) == {"meta"}, initialised
    assert all(p.is_meta for p in model.parameters())
