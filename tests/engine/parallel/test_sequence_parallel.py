"""Ulysses sequence parallelism (engine/parallel/sequence_parallel.py) against one process.

As in tests/engine/parallel/test_tensor_parallel.py, each pytest function launches this file on gloo
ranks with a *scenario*; the ranks run every check, write the names of those that passed (and
the largest differences they measured), and the test asserts the list. References are
single-process engines built in the same processes before the process group exists. ``sp``
runs 2 ranks (sequence_parallel_size=2, no data parallelism); ``dp_sp`` runs 4 ranks (2
data-parallel x 2 sequence-parallel, FSDP2 over all four), the costlier one.

Every comparison covers the loss, every metric, the grad norm, every full gradient and the
parameters after each of two optimizer steps, with the tolerances of the TP tests. The
mini-batch has uneven lengths and a one-token row that forms a micro-batch of its own (shorter
than the group: one rank holds padding only); packed micro-batches put a sequence across the
boundary of the two ranks' slices.

``optim.cpu_offload`` (FSDP2's ``CPUOffloadPolicy`` on the dp x sp sharding) is compared with
the same references: on the CPU its copies are no-ops, so a run with it must agree with one
process exactly as the run without it does; a checkpoint saved with it on resumes exactly with
it off and vice versa.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import (
    VOCAB,
    actor_config,
    check_rank0_loading,
    full_params,
    hf_logprobs,
    make_batch,
    pair_batch,
    run_scenario,
    scenario_main,
    single_process,
    tiny_model,
)
from sequence_parallel_utils import (
    SP_LENGTHS,
    build_engine,
    compare_steps,
    llama_mqa,
    run_steps,
    write_json,
)

from microrl.configs.engine import CriticConfig, EngineConfig, LoraConfig, OptimConfig

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).resolve()
ADAM = OptimConfig(name="adamw", lr=1e-2, grad_clip=0.5)
SGD = OptimConfig(name="sgd", lr=1.0, grad_clip=None)
SHARDS = ([0, 1, 2, 3, 4], [5, 6])  # dp x sp: the rows of each data-parallel index
PROMPTS = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
PROMPT_MASK = torch.ones_like(PROMPTS)
PROMPT_MASK[1, :2] = 0  # left padding
GREEDY = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)


# ============================================================================ pytest side


def _run(tmp_path: Path, nproc: int, scenario: str) -> list[str]:
    return run_scenario(tmp_path, nproc, HERE, scenario, timeout=540)


def test_sp2_engine_equals_one_process(tmp_path):
    passed = _run(tmp_path, 2, "sp")
    expected = [
        "actor[full]",
        "actor[lora]",
        "actor[lora,packed,grad_ckpt,budget]",
        "actor[eager,kernel+loss,temperature,adamw]",
        "actor[llama,mqa,lora,grad_ckpt]",
        "actor[qwen3,packed,tied]",
        "critic",
        "critic[lora,packed,grad_ckpt]",
        "reward_model[lora]",
        "reward_model[packed]",
        "local_tokens_and_fused_loss",
        "inference_and_reference",
        "generate",
        "checkpoint_resume_exact",
        "actor[lora,cpu_offload]",
        "critic[cpu_offload]",
        "cpu_offload_resume_across_the_switch",
        "same_batch_check",
        "refusals",
        "rank0_loading",
    ]
    assert sorted(passed) == sorted(expected)


def test_dp2_x_sp2_on_four_processes_equals_one_process(tmp_path):
    """4 processes (dp=2 x sp=2, FSDP2 over all four): full fine-tune, LoRA with packing (also
    with optim.cpu_offload), critic, and a dp index whose share is empty ([0, T] on both of its
    sp ranks)."""
    passed = _run(tmp_path, 4, "dp_sp")
    expected = [
        "dp_sp[critic]",
        "dp_sp[empty_share]",
        "dp_sp[full]",
        "dp_sp[lora,packed,cpu_offload]",
        "dp_sp[lora,packed]",
    ]
    assert sorted(passed) == expected


# ============================================================================ rank side


def _qwen3_tied(seed: int = 0):
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
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def _eager():
    model = tiny_model()
    model.set_attn_implementation("eager")
    return model


def _temperature_batch():
    batch = make_batch(SP_LENGTHS)
    batch["temperature"] = torch.linspace(0.7, 1.3, len(SP_LENGTHS))
    return batch


def _cases():
    """``(name, model, role, config, batch)``: every case runs two optimizer steps (LoRA's A
    gets its first non-zero gradient in the second, B starting at 0)."""
    lora = dict(lora=4)
    packed = dict(pack_sequences=True, gradient_checkpointing=True)
    batch = lambda: make_batch(SP_LENGTHS)  # noqa: E731
    yield "actor[full]", tiny_model, "actor", actor_config(check_grad_flow="error"), batch
    yield "actor[lora]", tiny_model, "actor", actor_config(**lora), batch
    yield (
        "actor[lora,packed,grad_ckpt,budget]",
        tiny_model,
        "actor",
        actor_config(
            **lora,
            **packed,
            micro_batch_size=None,
            max_tokens_per_micro_batch=24,
            loss_agg_mode="seq-mean-token-mean",
        ),
        batch,
    )
    yield (
        "actor[eager,kernel+loss,temperature,adamw]",
        _eager,
        "actor",
        actor_config(fuse_loss=False, compute_entropy=True, optim=ADAM),
        _temperature_batch,
    )
    yield (
        "actor[llama,mqa,lora,grad_ckpt]",
        llama_mqa,
        "actor",
        actor_config(**lora, gradient_checkpointing=True),
        batch,
    )
    yield "actor[qwen3,packed,tied]", _qwen3_tied, "actor", actor_config(**packed), batch
    critic = dict(micro_batch_size=2, optim=SGD)
    yield "critic", tiny_model, "critic", CriticConfig(**critic), batch
    # lr 0.1 for the value-head roles with LoRA: at lr 1 their first step magnifies fp32 rounding
    # in the second step's gradients past the tolerance (2e-6 to 5e-6 relative), in one process
    # too: micro_batch_size=1 (critic) or 4 (reward model) against 2 moves them as much.
    value_roles = dict(micro_batch_size=2, optim=replace(SGD, lr=0.1))
    yield (
        "critic[lora,packed,grad_ckpt]",
        tiny_model,
        "critic",
        CriticConfig(**value_roles, **packed, lora=LoraConfig(rank=4, alpha=8.0)),
        batch,
    )
    rm = value_roles
    yield (
        "reward_model[lora]",
        tiny_model,
        "reward",
        EngineConfig(**rm, lora=LoraConfig(rank=4, alpha=8.0)),
        pair_batch,
    )
    yield "reward_model[packed]", tiny_model, "reward", EngineConfig(**rm, **packed), pair_batch


def _offloaded(config):
    """``config`` with ``optim.cpu_offload`` on."""
    return replace(config, optim=replace(config.optim, cpu_offload=True))


def _offload_policies(build):
    """``build()`` and the ``offload_policy`` each FSDP2 unit it shards got."""
    from microrl.engine.parallel import distributed as D

    policies, real = [], D.fully_shard

    def spy(module, **kwargs):
        policies.append(kwargs.get("offload_policy"))
        return real(module, **kwargs)

    D.fully_shard = spy
    try:
        return build(), policies
    finally:
        D.fully_shard = real


def _check_offloaded(engine, policies) -> None:
    """Every FSDP2 unit got the policy (no pinning on the CPU); the shards are host tensors."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert policies and all(p == CPUOffloadPolicy(pin_memory=False) for p in policies), policies
    assert all(p.to_local().device.type == "cpu" for p in engine.module.parameters())


def scenario_sp(rank: int, tmp: Path) -> list[str]:
    import torch.distributed as dist

    from microrl.engine import ActorEngine
    from microrl.engine.parallel import distributed as D

    batch = make_batch(SP_LENGTHS)
    mask = batch["attention_mask"].bool()
    resume = actor_config(lora=4, optim=ADAM, pack_sequences=True)

    def references():
        refs = {}
        for name, build, role, config, data in _cases():
            refs[name] = run_steps(build_engine(role, build, config), data())
        engine = ActorEngine(tiny_model(), actor_config(lora=4))
        engine.train_batch(batch)
        refs["infer"] = engine.infer_batch(batch)
        with engine.disable_adapter():
            refs["reference"] = engine.infer_batch(batch)["logprobs"]
        refs["generate"] = engine.model.generate(
            input_ids=PROMPTS, attention_mask=PROMPT_MASK, generation_config=GREEDY
        )
        return refs

    refs = single_process(references)
    passed, worst = [], {}
    for name, build, role, config, data in _cases():
        engine = build_engine(role, build, config, sp=2)
        assert engine.device_mesh["sp"].size() == 2 and engine.device_mesh["dp"].size() == 1
        compare_steps(name, refs[name], run_steps(engine, data()), worst)
        passed.append(name)

    # ---- each rank embeds 1/2 of every micro-batch's tokens (the width padded to even), and
    # the default loss runs inside the fused head on them, once per micro-batch
    from microrl.engine import models

    real_loss = models.fused_linear_loss
    seen, calls = [], []
    models.fused_linear_loss = lambda *a, **k: calls.append(1) or real_loss(*a, **k)
    try:
        for pack, widths in ((False, [(2, 6), (2, 5), (2, 3), (1, 1)]), (True, [11, 8, 5, 1])):
            seen.clear()
            calls.clear()
            config = actor_config(pack_sequences=pack, sequence_parallel_size=2)
            engine = ActorEngine(tiny_model(), config)
            embedding = engine.model.get_input_embeddings()
            hook = embedding.register_forward_pre_hook(
                lambda _, args: seen.append(tuple(args[0].shape))
            )
            engine.forward_backward_batch(batch)
            hook.remove()
            assert seen == [(1, w) if pack else w for w in widths], seen
            assert len(calls) == 4, calls
    finally:
        models.fused_linear_loss = real_loss
    passed.append("local_tokens_and_fused_loss")

    # ---- inference and the reference policy (LoRA off): gathered outputs in the caller's layout
    engine = ActorEngine(tiny_model(), actor_config(lora=4, sequence_parallel_size=2))
    engine.train_batch(batch)
    outputs = engine.infer_batch(batch)
    assert outputs["logprobs"].shape == batch["input_ids"].shape
    for key in ("logprobs", "entropy"):
        err = (outputs[key] - refs["infer"][key]).abs().max().item()
        assert err <= 1e-5, (key, err)
        worst.setdefault("infer_batch", {})[key] = err
    with engine.disable_adapter():
        reference = engine.infer_batch(batch)["logprobs"]
    assert (reference - refs["reference"]).abs().max() <= 1e-5
    assert (reference[mask] - hf_logprobs(tiny_model(), batch)[mask]).abs().max() <= 2e-5
    passed.append("inference_and_reference")

    # ---- generate (no shard: the base attention with transformers' mask), left-padded prompts
    with D.gathered(engine.module):
        sequences = engine.model.generate(
            input_ids=PROMPTS, attention_mask=PROMPT_MASK, generation_config=GREEDY
        )
    assert torch.equal(sequences, refs["generate"]), "generation differs under SP"
    passed.append("generate")

    # ---- checkpoints: resume on the same layout exactly
    engine = ActorEngine(tiny_model(), replace(resume, sequence_parallel_size=2))
    engine.train_batch(batch)
    engine.save_checkpoint(tmp / "ckpt")
    engine.train_batch(make_batch(seed=11))
    uninterrupted = full_params(engine)
    torch.manual_seed(999)
    resumed = ActorEngine(tiny_model(), replace(resume, sequence_parallel_size=2))
    resumed.load_checkpoint(tmp / "ckpt")
    resumed.train_batch(make_batch(seed=11))
    for key, value in full_params(resumed).items():
        assert torch.equal(value, uninterrupted[key]), f"resume: {key} differs"
    passed.append("checkpoint_resume_exact")

    # ---- optim.cpu_offload over the dp x sp ranks: the references are the runs without it
    cases = {name: case for name, *case in _cases()}
    for name, offloaded in (
        ("actor[lora]", "actor[lora,cpu_offload]"),
        ("critic", "critic[cpu_offload]"),
    ):
        build, role, config, data = cases[name]
        engine, policies = _offload_policies(
            partial(build_engine, role, build, _offloaded(config), 2)
        )
        _check_offloaded(engine, policies)
        compare_steps(offloaded, refs[name], run_steps(engine, data()), worst)
        passed.append(offloaded)

    # ---- resume across the switch: saved with offload on, loaded with it off, and vice versa
    def sp_engine(offload: bool):
        config = replace(resume, sequence_parallel_size=2)
        return ActorEngine(tiny_model(), _offloaded(config) if offload else config)

    for saved_with in (True, False):
        engine = sp_engine(saved_with)
        engine.train_batch(batch)
        engine.save_checkpoint(tmp / f"ckpt_offload{int(saved_with)}")
        engine.train_batch(make_batch(seed=11))
        uninterrupted = full_params(engine)
        torch.manual_seed(1234 + rank)  # another LoRA initialisation: the checkpoint restores it
        resumed = sp_engine(not saved_with)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed.load_checkpoint(tmp / f"ckpt_offload{int(saved_with)}")
        assert any("optim.cpu_offload" in str(w.message) for w in caught), caught
        resumed.train_batch(make_batch(seed=11))
        for key, value in full_params(resumed).items():
            assert torch.equal(value, uninterrupted[key]), f"saved with {saved_with}: {key}"
    passed.append("cpu_offload_resume_across_the_switch")

    # ---- the ranks of an sp group must pass the same mini-batch
    engine = ActorEngine(tiny_model(), actor_config(sequence_parallel_size=2))
    with pytest.raises(ValueError, match="must pass the same mini-batch"):
        engine.forward_backward_batch(make_batch(SP_LENGTHS, seed=1 + rank))
    passed.append("same_batch_check")

    # ---- refusals that need a process group
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="model family 'gpt2' is not supported"):
        ActorEngine(gpt2, actor_config(sequence_parallel_size=2))
    odd = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=1,
            vocab_size=VOCAB,
        )
    )
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 must divide .*\(3"):
        ActorEngine(odd, actor_config(sequence_parallel_size=2))
    with pytest.raises(ValueError, match=r"sequence_parallel_size=4 must divide .* \(2\)"):
        ActorEngine(tiny_model(), actor_config(sequence_parallel_size=4))
    passed.append("refusals")

    check_rank0_loading(tmp, sequence_parallel_size=2)
    passed.append("rank0_loading")
    dist.barrier()
    if rank == 0:
        write_json(tmp, "sp_worst.json", worst)
    return passed


def _dp_sp_cases():
    yield "dp_sp[full]", "actor", actor_config(check_grad_flow="error")
    yield "dp_sp[lora,packed]", "actor", actor_config(lora=4, pack_sequences=True)
    yield "dp_sp[critic]", "critic", CriticConfig(micro_batch_size=2, optim=SGD)


def scenario_dp_sp(rank: int, tmp: Path) -> list[str]:
    """dp = rank // 2 (the mesh's rows): both sp ranks of a dp index get the same rows; dp index
    1 has fewer rows, so it runs empty micro-batches."""
    batch = make_batch(SP_LENGTHS)

    empty = actor_config(lora=4)  # dp index 1 passes [0, T]: placeholder micro-batches

    def references():
        refs = {
            name: run_steps(build_engine(role, tiny_model, config), batch)
            for name, role, config in _dp_sp_cases()
        }
        refs["empty"] = run_steps(build_engine("actor", tiny_model, empty), batch[SHARDS[0]])
        return refs

    refs = single_process(references)
    passed, worst = [], {}
    for name, role, config in _dp_sp_cases():
        engine = build_engine(role, tiny_model, config, sp=2)
        dp = engine.device_mesh["dp"]
        assert dp.size() == 2 and dp.get_local_rank() == rank // 2
        got = run_steps(engine, batch[SHARDS[dp.get_local_rank()]])
        # This rank's outputs are its dp share's rows of the whole mini-batch's.
        ref = [(*r[:5], {k: v[SHARDS[rank // 2]] for k, v in r[5].items()}) for r in refs[name]]
        compare_steps(name, ref, got, worst)
        passed.append(name)
        if name == "dp_sp[lora,packed]":  # optim.cpu_offload over the four ranks
            build = partial(build_engine, role, tiny_model, _offloaded(config), 2)
            engine, policies = _offload_policies(build)
            _check_offloaded(engine, policies)
            got = run_steps(engine, batch[SHARDS[dp.get_local_rank()]])
            compare_steps("dp_sp[lora,packed,cpu_offload]", ref, got, worst)
            passed.append("dp_sp[lora,packed,cpu_offload]")
    engine = build_engine("actor", tiny_model, empty, sp=2)
    mine = batch[SHARDS[0]] if rank < 2 else batch[:0]
    ref = [(*r[:5], {k: v[: len(mine)] for k, v in r[5].items()}) for r in refs["empty"]]
    compare_steps("dp_sp[empty_share]", ref, run_steps(engine, mine), worst)
    passed.append("dp_sp[empty_share]")
    if rank == 0:
        write_json(tmp, "dp_sp_worst.json", worst)
    return passed


def main(scenario: str, tmp: str) -> None:
    scenario_main(globals(), scenario, tmp)


if __name__ == "__main__":
    main(*sys.argv[1:])
