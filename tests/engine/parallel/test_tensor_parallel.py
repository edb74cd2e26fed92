"""Tensor parallelism (engine/parallel/tensor_parallel.py) against one process, on gloo ranks.

As in tests/engine/parallel/test_distributed.py, each pytest function launches this file on gloo ranks with
a *scenario*; the ranks run every check, write the names of those that passed, and the test
asserts the list. References are single-process engines built in the same processes before the
process group exists. ``tp`` runs 2 ranks (tensor_parallel_size=2, no data parallelism);
``dp_tp`` runs 4 ranks (2 data-parallel x 2 tensor-parallel, FSDP2 over the dp dimension), the
costlier one (4 processes on 2 cores), run by default like every test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import (
    VOCAB,
    actor_config,
    assert_max_close,
    assert_metrics_close,
    check_rank0_loading,
    full_params,
    full_tensor,
    hf_logprobs,
    make_batch,
    run_scenario,
    scenario_main,
    single_process,
    tiny_model,
)

from microrl.configs.engine import ActorConfig, CriticConfig, LoraConfig, OptimConfig

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).resolve()
ADAM = OptimConfig(name="adamw", lr=1e-2, grad_clip=0.5)
PROMPTS = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
GREEDY = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
SHARDS = ([0, 1, 2, 3, 4], [5, 6])  # dp x tp: the rows of each data-parallel index
# TP checks: uneven rows whose micro-batches of 2 rows are 12, 9, 10 and 4 wide (compacted): the
# layers run on local tensors, so a new width costs no DTensor sharding propagation.
TP_LENGTHS = (12, 5, 9, 3, 7, 10, 4)


# ============================================================================ pytest side


def _run(tmp_path: Path, nproc: int, scenario: str) -> list[str]:
    return run_scenario(tmp_path, nproc, HERE, scenario, timeout=300)


def test_tp2_engine_equals_one_process(tmp_path):
    passed = _run(tmp_path, 2, "tp")
    expected = [
        "actor[full]",
        "actor[lora]",
        "actor[lora,packed,grad_ckpt,budget]",
        "actor[tied,adamw,clip]",
        "actor[llama,lora]",
        "actor[qwen3]",
        "actor[llama,head_bias]",
        "critic",
        "inference_and_reference",
        "generate",
        "export",
        "checkpoint_resume_exact",
        "refusals",
        "rank0_loading",
        "fused_loss_in_the_vocab_parallel_head",
    ]
    assert sorted(passed) == sorted(expected)
    # The TP=2 checkpoint in one process, TP=1: DCP reassembles the shards (a warning says that
    # the per-rank RNG streams are not restored); the state is the one saved.
    from safetensors.torch import load_file

    from microrl.engine import ActorEngine

    engine = ActorEngine(tiny_model(), _resume_config(tp=1))
    with pytest.warns(UserWarning, match="RNG states not restored"):
        engine.load_checkpoint(tmp_path / "ckpt")
    expected_state = load_file(str(tmp_path / "at_save.safetensors"))
    got = _state(engine)
    assert expected_state.keys() == got.keys()
    for key, value in expected_state.items():
        assert torch.equal(value, got[key]), key


@pytest.mark.slow
def test_dp2_x_tp2_on_four_processes_equals_one_process(tmp_path):
    """4 processes (dp=2 x tp=2, FSDP2 over dp): full fine-tune, LoRA with packing, critic."""
    passed = _run(tmp_path, 4, "dp_tp")
    expected = ["dp_tp[full]", "dp_tp[lora]", "dp_tp[critic]", "dp_tp[rank0_loading]"]
    assert sorted(passed) == sorted(expected)


def test_config_and_single_process_refusals():
    from microrl.engine import ActorEngine

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            ActorConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match=r"lora\.dropout"):
        ActorConfig(tensor_parallel_size=2, lora=LoraConfig(rank=4, dropout=0.1))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 processes"):
        ActorEngine(tiny_model(), actor_config(tensor_parallel_size=2))


def test_family_and_divisibility_checks():
    from transformers import GPT2Config, Qwen2Config

    from microrl.engine.parallel.tensor_parallel import check_supported

    with pytest.raises(ValueError, match="model family 'gpt2' is not supported"):
        check_supported(GPT2Config(), 2)
    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    assert check_supported(config, 2)["self_attn.o_proj"] == "rowwise"
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\)"):
        check_supported(config, 4)


# ============================================================================ rank side


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _llama_head_bias(seed: int = 0) -> LlamaForCausalLM:
    """Llama with a biased lm head (Phi-style): the bias is vocab-sharded with the weight."""
    model = _llama(seed)
    head = torch.nn.Linear(32, VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.copy_(torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)))
    model.lm_head = head
    return model


def _qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config)


def _grads(engine) -> dict[str, torch.Tensor]:
    return {
        n: full_tensor(p.grad).clone()
        for n, p in engine.module.named_parameters()
        if p.grad is not None
    }


def _steps(engine, batch, steps: int) -> list:
    """Per step: loss, metrics, every gradient (before the step), parameters after it."""
    record = []
    for _ in range(steps):
        engine.optimizer.zero_grad(set_to_none=True)
        result = engine.forward_backward_batch(batch)
        grads = _grads(engine)
        grad_norm = engine.optimizer_step()
        record.append((result["loss"], result["metrics"], grad_norm, grads, full_params(engine)))
    return record


def _compare(name: str, ref: list, got: list) -> None:
    for step, (r, g) in enumerate(zip(ref, got, strict=True)):
        what = f"{name} step {step}"
        assert abs(r[0] - g[0]) <= 1e-5 * max(1.0, abs(r[0])), (what, r[0], g[0])
        assert_metrics_close(r[1], g[1], what)
        assert abs(r[2] - g[2]) <= 1e-5 * max(1.0, r[2]), (what, "grad_norm", r[2], g[2])
        assert r[3].keys() == g[3].keys(), (what, r[3].keys() ^ g[3].keys())
        for n in r[3]:  # fp32 sums over the shards in another order: relative 1e-6
            atol = 1e-6 * max(1.0, r[3][n].abs().max().item())
            assert_max_close(g[3][n], r[3][n], f"{what} grad {n}", atol)
        for n in r[4]:
            assert_max_close(g[4][n], r[4][n], f"{what} param {n}", 1e-5)


def _cases():
    """``(name, model, role, config, steps)``: LoRA cases take 2 steps (B starts at 0, so A
    gets its first non-zero gradient in the second)."""
    lora4 = dict(lora=4)
    # The grad-flow audit runs on the tensor-parallel gradients too (it raises on a dead one).
    yield "actor[full]", tiny_model, "actor", actor_config(check_grad_flow="error"), 1
    yield "actor[lora]", tiny_model, "actor", actor_config(**lora4), 2
    yield (
        "actor[lora,packed,grad_ckpt,budget]",
        tiny_model,
        "actor",
        actor_config(
            **lora4,
            micro_batch_size=None,
            max_tokens_per_micro_batch=40,
            pack_sequences=True,
            gradient_checkpointing=True,
            loss_agg_mode="seq-mean-token-mean",
        ),
        1,
    )
    yield (
        "actor[tied,adamw,clip]",
        lambda: tiny_model(tie=True),
        "actor",
        actor_config(optim=ADAM, compute_entropy=True),
        1,
    )
    yield "actor[llama,lora]", _llama, "actor", actor_config(**lora4), 1
    yield "actor[qwen3]", _qwen3, "actor", actor_config(), 1
    entropy = actor_config(compute_entropy=True)
    yield "actor[llama,head_bias]", _llama_head_bias, "actor", entropy, 1
    critic = dict(micro_batch_size=2, optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None))
    yield "critic", tiny_model, "critic", CriticConfig(**critic), 1


def _engine(role: str, build, config, tp: int = 1):
    from dataclasses import replace

    from microrl.engine import ActorEngine, CriticEngine

    cls = ActorEngine if role == "actor" else CriticEngine
    return cls(build(), replace(config, tensor_parallel_size=tp))


def _resume_config(tp: int) -> ActorConfig:
    return actor_config(lora=4, optim=ADAM, tensor_parallel_size=tp)


def _state(engine) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state as full tensors, plus learning rates and step."""
    out = {f"param.{n}": t.contiguous() for n, t in full_params(engine).items()}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for param, entry in engine.optimizer.state.items():
        for key, value in entry.items():
            out[f"optim.{names[id(param)]}.{key}"] = full_tensor(value).detach().clone().reshape(-1)
    out["step"] = torch.tensor([engine.global_step])
    return out


def scenario_tp(rank: int, tmp: Path) -> list[str]:
    import torch.distributed as dist
    from export_utils import check_lm_exports
    from torch.distributed.tensor import DTensor

    from microrl.engine import ActorEngine

    batch = make_batch(TP_LENGTHS)
    mask = batch["attention_mask"].bool()

    def references():
        refs = {}
        for name, build, role, config, steps in _cases():
            refs[name] = _steps(_engine(role, build, config), batch, steps)
        engine = ActorEngine(tiny_model(), _resume_config(tp=1))
        engine.train_batch(batch)
        refs["infer"] = engine.infer_batch(batch)
        refs["generate"] = engine.model.generate(input_ids=PROMPTS, generation_config=GREEDY)
        return refs

    refs = single_process(references)
    passed = []
    for name, build, role, config, steps in _cases():
        engine = _engine(role, build, config, tp=2)
        assert engine.device_mesh is not None and engine.device_mesh["dp"].size() == 1
        _compare(name, refs[name], _steps(engine, batch, steps))
        passed.append(name)

    # ---- the default loss runs inside the vocab-parallel head (the fused loss path), once per
    # micro-batch: the comparisons above then cover it
    from microrl.kernels import vocab_parallel_loss

    calls, real = [], vocab_parallel_loss.vocab_parallel_linear_loss
    vocab_parallel_loss.vocab_parallel_linear_loss = lambda *a, **k: (
        calls.append(1) or real(*a, **k)
    )
    try:
        engine = ActorEngine(tiny_model(), actor_config(tensor_parallel_size=2))
        engine.forward_backward_batch(batch)
    finally:
        vocab_parallel_loss.vocab_parallel_linear_loss = real
    assert len(calls) == 4, calls  # 7 rows in micro-batches of 2
    passed.append("fused_loss_in_the_vocab_parallel_head")

    # ---- the layout: Shard(0) lm head read by the vocab-parallel kernel, adapters as documented
    from safetensors.torch import save_file

    engine = ActorEngine(tiny_model(), _resume_config(tp=2))
    head = engine.model.get_output_embeddings().weight
    assert isinstance(head, DTensor) and head.to_local().shape == (VOCAB // 2, 32)
    params = dict(engine.module.named_parameters())
    q = "causal_lm.model.layers.0.self_attn.q_proj"
    o = "causal_lm.model.layers.0.self_attn.o_proj"
    assert params[f"{q}.lora_B.default.weight"].to_local().shape == (16, 4)  # colwise B
    assert params[f"{q}.lora_A.default.weight"].to_local().shape == (4, 32)  # replicated A
    assert params[f"{o}.lora_A.default.weight"].to_local().shape == (4, 16)  # rowwise A
    assert params[f"{o}.lora_B.default.weight"].to_local().shape == (32, 4)  # replicated B
    engine.train_batch(batch)
    engine.save_checkpoint(tmp / "ckpt")  # resumed below
    at_save = _state(engine)
    if rank == 0:
        save_file(at_save, str(tmp / "at_save.safetensors"))
    outputs = engine.infer_batch(batch)
    for key in ("logprobs", "entropy"):
        assert_max_close(outputs[key], refs["infer"][key], f"infer {key}", 1e-5)
    with engine.disable_adapter():
        reference = engine.infer_batch(batch)["logprobs"]
    assert_max_close(reference[mask], hf_logprobs(tiny_model(), batch)[mask], "reference", 2e-5)
    passed.append("inference_and_reference")

    sequences = engine.model.generate(input_ids=PROMPTS, generation_config=GREEDY)
    assert torch.equal(sequences, refs["generate"]), "generation differs under TP"
    passed.append("generate")

    # ---- exports gathered from the shards (the checks: export_utils.py)
    check_lm_exports(engine, batch, refs["infer"]["logprobs"], tmp, rank=rank)
    dist.barrier()
    passed.append("export")

    # ---- checkpoints: resume on the same layout exactly (the TP=1 load runs in pytest)
    engine.train_batch(make_batch(seed=11))
    uninterrupted = _state(engine)
    torch.manual_seed(999)
    resumed = ActorEngine(tiny_model(), _resume_config(tp=2))
    resumed.load_checkpoint(tmp / "ckpt")
    resumed.train_batch(make_batch(seed=11))
    got = _state(resumed)
    assert uninterrupted.keys() == got.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(value, got[key]), f"resume: {key} differs"
    passed.append("checkpoint_resume_exact")

    # ---- refusals that need a process group
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="model family 'gpt2' is not supported"):
        ActorEngine(gpt2, actor_config(tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide .* \(2\)"):
        ActorEngine(tiny_model(), actor_config(tensor_parallel_size=4))
    passed.append("refusals")
    check_rank0_loading(tmp, tensor_parallel_size=2)
    passed.append("rank0_loading")
    return passed


def _dp_tp_cases():
    yield "dp_tp[full]", "actor", actor_config(check_grad_flow="error")
    yield "dp_tp[lora]", "actor", actor_config(lora=4, pack_sequences=True)
    critic = dict(micro_batch_size=2, optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None))
    yield "dp_tp[critic]", "critic", CriticConfig(**critic)


def scenario_dp_tp(rank: int, tmp: Path) -> list[str]:
    """dp = rank // 2 (the mesh's rows): both tp ranks of a dp index get the same rows."""
    from torch.distributed.fsdp import FSDPModule

    batch = make_batch()

    def references():
        refs = {}
        for name, role, config in _dp_tp_cases():
            engine = _engine(role, tiny_model, config)
            before = full_params(engine)
            metrics = engine.train_batch(batch)
            refs[name] = (metrics, {n: p - before[n] for n, p in full_params(engine).items()})
        return refs

    refs = single_process(references)
    mine = batch[SHARDS[rank // 2]]
    passed = []
    for name, role, config in _dp_tp_cases():
        engine = _engine(role, tiny_model, config, tp=2)
        assert isinstance(engine.module, FSDPModule) and engine.device_mesh["dp"].size() == 2
        before = full_params(engine)
        metrics = engine.train_batch(mine)
        ref_metrics, ref_delta = refs[name]
        assert_metrics_close(ref_metrics, metrics, name)
        for n, p in full_params(engine).items():
            assert_max_close(p - before[n], ref_delta[n], f"{name} {n}", 1e-5)
        passed.append(name)
    check_rank0_loading(tmp, tensor_parallel_size=2)  # global rank 0 loads for the 2-D mesh
    passed.append("dp_tp[rank0_loading]")
    return passed


def main(scenario: str, tmp: str) -> None:
    scenario_main(globals(), scenario, tmp)


if __name__ == "__main__":
    main(*sys.argv[1:])
