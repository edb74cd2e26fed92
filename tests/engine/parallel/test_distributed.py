"""Data parallelism on 2 gloo ranks: DP invariance, sharded fused head, gradient sync, resume.

Each pytest function launches this same file on gloo ranks (``distributed_utils.launch``: the
environment torchrun gives its workers, without the launcher process) with a *scenario* name; the ranks run every check of the scenario, write
the names of the checks that passed, and the test asserts that all of them did (a scenario that
silently ran nothing fails). References are computed in the same processes *before* the process
group exists (an unsharded engine on the whole mini-batch), so no file has to cross processes,
except for the resume checks, where a fresh launch must reproduce the first one's results.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import (
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

from microrl.configs.engine import CriticConfig, LoraConfig, OptimConfig
from microrl.losses import AggMode

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).resolve()
# Rows of the mini-batch each rank gets in the DP checks: 5 vs 2 rows, so with micro-batch size 2
# rank 1 needs 1 micro-batch where rank 0 needs 3 (it runs 2 empty ones).
SHARDS = ([0, 1, 2, 3, 4], [5, 6])
MODES = [m.value for m in AggMode]
K_STEPS, M_STEPS = 2, 2
PROMPTS = torch.randint(0, 128, (4, 5), generator=torch.Generator().manual_seed(3))
# Every rank decodes the same number of steps (no eos): the sharded layers gather collectively.
GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
ADAM = OptimConfig(
    name="adamw", lr=1e-2, warmup_steps=1, schedule="cosine", total_steps=6, grad_clip=0.5
)


# ============================================================================ pytest side


def _run(tmp_path: Path, nproc: int, scenario: str) -> list[str]:
    return run_scenario(tmp_path, nproc, HERE, scenario)


def test_dp_invariance_sharded_head_and_gradient_sync(tmp_path):
    passed = _run(tmp_path, 2, "dp")
    expected = [f"dp_invariance[{m},lora={r}]" for m in MODES for r in (0, 4)]
    expected += ["dp_invariance[packed]", "dp_invariance[grad_ckpt]", "dp_invariance[tied]"]
    expected += [
        "fused_head_sees_full_weight",
        "clipping_uses_global_norm",
        "one_gradient_reduction_per_mini_batch",
        "all_masked_shard",
        "empty_shard",
        "ranks_start_from_rank0_weights",
        "critic_dp_invariance",
        "export_roundtrip_under_fsdp",
        "generate_then_train_under_fsdp",
        "rank0_loading",
    ]
    assert sorted(passed) == sorted(expected)


def test_resume_is_exact_on_two_ranks_and_reshards_to_one(tmp_path):
    assert _run(tmp_path, 2, "resume_save") == ["saved"]
    assert _run(tmp_path, 2, "resume_load") == ["resumed_exactly"]
    # The 2-rank checkpoint on 1 rank (exact resume in one process: checkpoint/test_checkpoint.py).
    assert _run(tmp_path, 1, "reshard_load") == ["resharded_to_one_rank"]


def test_single_process_is_a_no_op_and_bad_input_is_named():

    from microrl.engine.parallel import distributed as D

    assert D.init_distributed() is None and D.dp_group() is None  # plain python: no group
    assert D.agree_num_micro_batches(3) == 3
    with pytest.raises(ValueError, match="num_micro_batches"):
        D.agree_num_micro_batches(-1)
    model = tiny_model()
    with pytest.raises(ValueError, match="initialised process group"):
        D.shard_model(model)
    with pytest.raises(TypeError, match=r"module must be an nn\.Module"):
        D.shard_model("model")
    with D.gathered(model):  # unsharded: nothing to gather
        pass
    D.set_gradient_sync(model, False)  # unsharded: nothing to switch


def test_shard_units_are_the_decoder_layers_also_under_peft_and_wrappers():
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    from microrl.engine.parallel import distributed as D

    model = tiny_model()
    layers = list(model.model.layers)
    assert D.find_shard_units(model) == layers
    wrapped = torch.nn.ModuleDict({"policy": model})  # the engine's wrapper holds the model
    assert D.find_shard_units(wrapped) == layers
    peft_model = get_peft_model(tiny_model(), PeftLora(r=2, target_modules=["q_proj"]))
    assert D.find_shard_units(peft_model) == list(peft_model.get_base_model().model.layers)
    # Tied input embeddings stay with the lm head in the root unit.
    assert D._untied_input_embeddings(model) == [model.model.embed_tokens]
    assert D._untied_input_embeddings(tiny_model(tie=True)) == []


def test_placeholder_row_stands_in_for_an_empty_share():
    from microrl.engine.parallel import distributed as D

    empty = make_batch()[:0]
    empty["temperature"] = torch.ones(0)  # a per-row temperature must stay valid (> 0)
    assert D.is_empty_batch(empty) and not D.is_empty_batch(make_batch())
    row = D.placeholder_row(empty)
    assert row["temperature"].tolist() == [1.0]
    assert row.batch_size == torch.Size([1])
    assert set(row.keys()) == set(empty.keys())
    assert row["attention_mask"].tolist()[0] == [True] + [False] * 11
    assert not row["loss_mask"].any()


# ============================================================================ rank side


def _dp_configs():
    for mode in MODES:
        for lora in (0, 4):
            kwargs = {"loss_agg_mode": mode}
            if mode == "seq-mean-token-sum-norm":
                kwargs["seq_len_norm"] = 8.0
            if mode == "seq-mean-token-mean":  # the token-budget planner too
                kwargs.update(micro_batch_size=None, max_tokens_per_micro_batch=20)
            yield f"dp_invariance[{mode},lora={lora}]", actor_config(lora=lora, **kwargs), False
    # Packing and gradient checkpointing change how the sharded layers are called; a tied
    # embedding stays in the root unit with the lm head.
    yield "dp_invariance[packed]", actor_config(lora=4, pack_sequences=True), False
    yield "dp_invariance[grad_ckpt]", actor_config(lora=4, gradient_checkpointing=True), False
    yield "dp_invariance[tied]", actor_config(), True


def scenario_dp(rank: int, tmp: Path) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from microrl.engine import ActorEngine, CriticEngine
    from microrl.engine.parallel import distributed as D

    batch = make_batch()
    mine = batch[SHARDS[rank]]
    clip_config = actor_config(lora=4, optim=OptimConfig(name="sgd", lr=1.0, grad_clip=1e-3))
    # The grad-flow audit is collective under FSDP (rank 1 holds an empty shard of the value
    # head's bias [1]; in the all-masked check rank 1 has no loss token).
    critic_config = CriticConfig(
        micro_batch_size=2,
        optim=OptimConfig(name="sgd", lr=1.0, grad_clip=None),
        check_grad_flow="error",
    )
    audited = actor_config(check_grad_flow="error")

    # ---- references: one process, the whole mini-batch (before any process group exists)
    def references():
        refs = {}
        for name, config, tie in [*_dp_configs(), ("clip", clip_config, False)]:
            engine = ActorEngine(tiny_model(tie=tie), config)
            before = full_params(engine)
            metrics = engine.train_batch(batch)
            refs[name] = (metrics, {n: p - before[n] for n, p in full_params(engine).items()})
        critic = CriticEngine(tiny_model(), critic_config)
        before = full_params(critic)
        metrics = critic.train_batch(batch)
        refs["critic"] = (metrics, {n: p - before[n] for n, p in full_params(critic).items()})
        engine = ActorEngine(tiny_model(), audited)
        before = full_params(engine)
        metrics = engine.train_batch(batch)
        refs["audited_whole_batch"] = (
            metrics,
            {n: p - before[n] for n, p in full_params(engine).items()},
        )
        engine = ActorEngine(tiny_model(), actor_config(lora=4))
        refs["generate"] = engine.model.generate(input_ids=PROMPTS, generation_config=GREEDY)
        return refs

    refs = single_process(references)
    passed = []

    # ---- DP invariance: the same update, loss and metrics from two halves
    for name, config, tie in _dp_configs():
        engine = ActorEngine(tiny_model(tie=tie), config)
        assert D.dp_group() is not None and isinstance(engine.module, FSDPModule)
        before = full_params(engine)
        metrics = engine.train_batch(mine)
        ref_metrics, ref_delta = refs[name]
        assert_metrics_close(ref_metrics, metrics, name)
        for n, p in full_params(engine).items():
            assert_max_close(p - before[n], ref_delta[n], f"{name} {n}")
        passed.append(name)

    # ---- the fused kernel gets the full lm-head weight inside the sharded forward
    engine = ActorEngine(tiny_model(), actor_config(lora=4))
    assert engine.uses_fused_kernel
    head = engine.model.get_output_embeddings().weight
    assert isinstance(head, DTensor) and head.to_local().shape[0] < head.shape[0]
    seen = []
    import microrl.engine.models as heads
    import microrl.kernels as kernels

    real = kernels.fused_linear_logprob

    def spy(hidden, weight, *args, **kwargs):
        seen.append((isinstance(weight, DTensor), tuple(weight.shape)))
        return real(hidden, weight, *args, **kwargs)

    kernels.fused_linear_logprob = spy
    if hasattr(heads, "fused_linear_logprob"):
        heads.fused_linear_logprob = spy
    try:
        logprobs = engine.infer_batch(batch)["logprobs"]
    finally:
        kernels.fused_linear_logprob = real
        if hasattr(heads, "fused_linear_logprob"):
            heads.fused_linear_logprob = real
    assert seen and all(s == (False, (128, 32)) for s in seen), seen
    unsharded = tiny_model()
    mask = batch["attention_mask"].bool()
    assert_max_close(
        logprobs[mask], hf_logprobs(unsharded, batch)[mask], "fused sharded log-probs", 2e-5
    )
    passed.append("fused_head_sees_full_weight")

    # ---- clipping by the global norm (a tiny max_norm: every update is clipped)
    engine = ActorEngine(tiny_model(), clip_config)
    before = full_params(engine)
    metrics = engine.train_batch(mine)
    ref_metrics, ref_delta = refs["clip"]
    assert metrics["grad_norm"] > 1e-3
    assert_metrics_close(ref_metrics, metrics, "clip")
    for n, p in full_params(engine).items():
        assert_max_close(p - before[n], ref_delta[n], f"clip {n}", 1e-8)
    passed.append("clipping_uses_global_norm")

    # ---- one reduce-scatter per FSDP unit per mini-batch, and equal micro-batch counts
    engine = ActorEngine(tiny_model(), actor_config())  # full fine-tune: every unit reduces
    units = sum(isinstance(m, FSDPModule) for m in engine.module.modules())
    assert units == 4, units  # 2 decoder layers, the (untied) embedding, the root
    calls, forwards = [], []
    real_rs = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        calls.append(1)
        return real_rs(*args, **kwargs)

    engine.module.register_forward_pre_hook(lambda *_: forwards.append(1))
    dist.reduce_scatter_single = counting
    try:
        engine.train_batch(mine)
        once = len(calls)
        calls.clear()
        real_sync = D.set_gradient_sync
        D.set_gradient_sync = lambda module, enabled: None  # what the check must catch
        try:
            engine.train_batch(mine)
        finally:
            D.set_gradient_sync = real_sync
        every = len(calls)
    finally:
        dist.reduce_scatter_single = real_rs
    assert len(forwards) == 6, f"rank {rank} ran {len(forwards)} forwards (3 per step expected)"
    assert once == units, f"{once} reduce-scatters for {units} FSDP units"
    assert every == 3 * units, f"without the sync switch: {every} reduce-scatters"
    passed.append("one_gradient_reduction_per_mini_batch")

    # ---- a rank whose share has no loss token at all: zero contribution, no deadlock
    silent = mine.clone()
    if rank == 1:
        silent["loss_mask"] = torch.zeros_like(silent["loss_mask"])
    engine = ActorEngine(tiny_model(), audited)
    before = full_params(engine)
    metrics = engine.train_batch(silent)
    delta = {n: p - before[n] for n, p in full_params(engine).items()}

    def only_rank0():
        engine = ActorEngine(tiny_model(), audited)
        before = full_params(engine)
        metrics = engine.train_batch(batch[SHARDS[0]])
        return metrics, {n: p - before[n] for n, p in full_params(engine).items()}

    ref_metrics, ref_delta = single_process(only_rank0)
    assert_metrics_close(ref_metrics, metrics, "all-masked shard")
    for n, d in delta.items():
        assert_max_close(d, ref_delta[n], f"all-masked shard {n}")
    passed.append("all_masked_shard")

    # ---- ranks that built different weights (seed = rank) all start from rank 0's
    model = tiny_model(seed=rank)
    rank0_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for tensor in rank0_weights.values():
        dist.broadcast(tensor, src=0)
    torch.manual_seed(100 + rank)  # different LoRA initialisations too
    engine = ActorEngine(model, actor_config(lora=4))
    lora_a = [p for n, p in engine.module.named_parameters() if "lora_A" in n]
    for tensor in [full_tensor(p.detach()).clone() for p in lora_a]:
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        assert_max_close(gathered[0], gathered[1], "LoRA A identical on every rank", atol=0.0)
    base = {n.replace("base_layer.", ""): p for n, p in engine.module.named_parameters()}
    for name, expected in rank0_weights.items():
        got = next(p for n, p in base.items() if n.endswith(name))
        assert_max_close(full_tensor(got.detach()), expected, f"rank 0's {name}", atol=0.0)
    passed.append("ranks_start_from_rank0_weights")

    # ---- a rank with no sequence at all: a [0, T] share runs placeholder micro-batches
    engine = ActorEngine(tiny_model(), audited)
    before = full_params(engine)
    share = batch if rank == 0 else batch[:0]
    metrics = engine.train_batch(share)
    ref_metrics, ref_delta = refs["audited_whole_batch"]
    assert_metrics_close(ref_metrics, metrics, "empty shard")
    for n, p in full_params(engine).items():
        assert_max_close(p - before[n], ref_delta[n], f"empty shard {n}")
    outputs = engine.infer_batch(share)
    assert outputs.batch_size == torch.Size([len(share)]) and "logprobs" in outputs
    passed.append("empty_shard")

    # ---- critic (value head bias [1]: one rank holds an empty shard of it)
    critic = CriticEngine(tiny_model(), critic_config)
    before = full_params(critic)
    metrics = critic.train_batch(mine)
    ref_metrics, ref_delta = refs["critic"]
    assert_metrics_close(ref_metrics, metrics, "critic")
    for n, p in full_params(critic).items():
        assert_max_close(p - before[n], ref_delta[n], f"critic {n}")
    passed.append("critic_dp_invariance")

    # ---- generation through the inner causal LM (bypassing the root) inside `gathered`,
    # before any training step (FSDP's lazy root detection must not pick a layer), then training
    engine = ActorEngine(tiny_model(), actor_config(lora=4))
    with D.gathered(engine.module):
        sequences = engine.model.generate(input_ids=PROMPTS[rank::2], generation_config=GREEDY)
    assert torch.equal(sequences, refs["generate"][rank::2]), "generation differs under FSDP"
    assert isinstance(engine.model.get_output_embeddings().weight, DTensor)  # resharded after
    before = full_params(engine)
    metrics = engine.train_batch(mine)
    ref_metrics, ref_delta = refs["dp_invariance[token-mean,lora=4]"]
    assert_metrics_close(ref_metrics, metrics, "train after generate")
    for n, p in full_params(engine).items():
        assert_max_close(p - before[n], ref_delta[n], f"train after generate {n}")
    passed.append("generate_then_train_under_fsdp")

    # ---- exports gathered from the sharded model (the checks: export_utils.py)
    from export_utils import check_lm_exports

    engine = ActorEngine(tiny_model(), actor_config(lora=4, optim=ADAM))
    engine.train_batch(mine)
    engine.train_batch(mine)
    expected = engine.infer_batch(batch)["logprobs"]
    with engine.disable_adapter():  # the reference policy: the base weights, still sharded
        reference = engine.infer_batch(batch)["logprobs"]
    assert_max_close(
        reference[mask], hf_logprobs(tiny_model(), batch)[mask], "disable_adapter", 2e-5
    )
    assert (reference - expected)[mask].abs().max() > 1e-4, "the adapter did not train"
    check_lm_exports(engine, batch, expected, tmp, rank=rank)
    dist.barrier()
    passed.append("export_roundtrip_under_fsdp")
    check_rank0_loading(tmp)
    passed.append("rank0_loading")
    return passed


def _resume_engines():
    from microrl.engine import ActorEngine, CriticEngine

    config = actor_config(optim=ADAM)
    config.lora = LoraConfig(rank=4, alpha=8.0, dropout=0.1)  # dropout: the RNG must resume
    actor = ActorEngine(tiny_model(), config)
    critic = CriticEngine(tiny_model(), CriticConfig(micro_batch_size=3, optim=ADAM))
    return actor, critic


def _state(engine) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state as full tensors, plus learning rates and step."""
    out = {f"param.{n}": t for n, t in full_params(engine).items()}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for param, entry in engine.optimizer.state.items():
        for key, value in entry.items():
            out[f"optim.{names[id(param)]}.{key}"] = full_tensor(value).detach().clone().reshape(-1)
    out["lrs"] = torch.tensor([g["lr"] for g in engine.optimizer.param_groups], dtype=torch.float64)
    out["step"] = torch.tensor([engine.global_step])
    return out


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


def _train(engines, steps, rank: int, world: int) -> None:
    for step in steps:
        batch = make_batch(seed=100 + step)
        for engine in engines:
            engine.train_batch(batch[list(range(rank, batch.batch_size[0], world))])


def _states(engines) -> dict[str, torch.Tensor]:
    """Every rank must call it (gathering shards is collective)."""
    out = {}
    for i, engine in enumerate(engines):
        out.update({f"{i}.{k}": v.contiguous() for k, v in _state(engine).items()})
    return out


def _save_expected(engines, path: Path, rank: int) -> None:
    from safetensors.torch import save_file

    states = _states(engines)
    if rank == 0:
        save_file(states, str(path))


def _assert_matches(engines, path: Path, what: str, rank: int) -> None:
    from safetensors.torch import load_file

    got = _states(engines)
    if rank != 0:
        return
    expected = load_file(str(path))
    assert expected.keys() == got.keys(), (what, expected.keys() ^ got.keys())
    for key, value in expected.items():
        assert torch.equal(value, got[key]), f"{what}: {key} differs"


def scenario_resume_save(rank: int, tmp: Path) -> list[str]:
    engines = _resume_engines()
    _train(engines, range(K_STEPS), rank, _world())
    for i, engine in enumerate(engines):
        assert engine.optimizer.state, "empty optimizer state: the resume check would be vacuous"
        engine.save_checkpoint(tmp / f"ckpt{i}")
    _save_expected(engines, tmp / "at_save.safetensors", rank)
    _train(engines, range(K_STEPS, K_STEPS + M_STEPS), rank, _world())
    _save_expected(engines, tmp / "uninterrupted.safetensors", rank)
    return ["saved"]


def scenario_resume_load(rank: int, tmp: Path) -> list[str]:
    torch.manual_seed(999)  # a fresh process with another RNG stream: the checkpoint restores it
    engines = _resume_engines()
    for i, engine in enumerate(engines):
        engine.load_checkpoint(tmp / f"ckpt{i}")
        assert engine.global_step == K_STEPS
    _train(engines, range(K_STEPS, K_STEPS + M_STEPS), rank, _world())
    _assert_matches(engines, tmp / "uninterrupted.safetensors", "resumed", rank)
    return ["resumed_exactly"]


def scenario_reshard_load(rank: int, tmp: Path) -> list[str]:
    engines = _resume_engines()
    for i, engine in enumerate(engines):
        with pytest.warns(UserWarning, match="RNG states not restored"):
            engine.load_checkpoint(tmp / f"ckpt{i}")
    _assert_matches(engines, tmp / "at_save.safetensors", "2-rank checkpoint on 1 rank", rank)
    return ["resharded_to_one_rank"]


def main(scenario: str, tmp: str) -> None:
    scenario_main(globals(), scenario, tmp)


if __name__ == "__main__":
    main(*sys.argv[1:])
