"""Optimizer and parameter offload (``optim.cpu_offload``: FSDP2's ``CPUOffloadPolicy``) on gloo.

On the CPU FSDP2's offload copies are no-ops, so a run with the policy computes exactly what a
run without it computes: parameters, gradients, optimizer state and metrics are compared with
``torch.equal`` (no tolerance), after two AdamW steps with clipping and a schedule. Against one
process without FSDP the 2-rank run agrees to fp32 summation order (``ATOL``, as in
``test_distributed.py``). Resume is exact across the switch: a checkpoint saved with offload on
loads with it off and vice versa, and one more step equals the uninterrupted run.

Single process: the engine shards with FSDP2 over one rank for the policy (it starts a process
group of one, engine/parallel/cpu_offload.py); the test ends that group. The 2-rank side is one
launch of this file (``distributed_utils.launch``) running every check; it also covers activation
offload under FSDP2 (its gathered parameters are never copied) and the clipping path the engine
takes for offloaded gradients on a GPU mesh (``clip_host_shards``), compared with torch's.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import (
    ATOL,
    actor_config,
    assert_max_close,
    assert_metrics_close,
    check_rank0_loading,
    full_params,
    full_tensor,
    launch,
    make_batch,
    single_process,
    tiny_model,
)

from microrl.configs import ActorConfig, CriticConfig, OptimConfig
from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config

HERE = Path(__file__).resolve()
SHARDS = ([0, 1, 2, 3, 4], [5, 6])  # rank 0: 3 micro-batches of 2 rows; rank 1: 1 + 2 empty
STEPS = 2


def _optim(on: bool) -> OptimConfig:
    return OptimConfig(
        name="adamw",
        lr=1e-2,
        warmup_steps=1,
        schedule="cosine",
        total_steps=6,
        grad_clip=0.5,
        cpu_offload=on,
    )


def _actor(on: bool, lora: int = 4):
    from microrl.engine import ActorEngine

    return ActorEngine(tiny_model(), actor_config(lora=lora, optim=_optim(on)))


def _run(engine, batches) -> list[tuple]:
    """Per step: loss, metrics, the full gradients, the grad norm; as ``train_batch`` does it."""
    out = []
    for batch in batches:
        engine.optimizer.zero_grad(set_to_none=True)
        result = engine.forward_backward_batch(batch)
        grads = {
            n: full_tensor(p.grad).clone()
            for n, p in engine.module.named_parameters()
            if p.grad is not None
        }
        norm = engine.optimizer_step()
        out.append((result["loss"], result["metrics"], grads, norm))
    return out


def _state(engine) -> dict[str, torch.Tensor]:
    """Full parameters and optimizer state by name, plus the learning rates and the step."""
    out = {f"param.{n}": t for n, t in full_params(engine).items()}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    for param, entry in engine.optimizer.state.items():
        for key, value in entry.items():
            out[f"optim.{names[id(param)]}.{key}"] = full_tensor(value).detach().clone()
    out["lrs"] = torch.tensor([g["lr"] for g in engine.optimizer.param_groups], dtype=torch.float64)
    out["step"] = torch.tensor([engine.global_step])
    return out


def _assert_equal_states(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, a.keys() ^ b.keys())
    assert any(k.startswith("optim.") for k in a), f"{what}: no optimizer state (vacuous)"
    for key, value in a.items():
        assert torch.equal(value, b[key]), f"{what}: {key} differs"


def _assert_equal_runs(ref: list[tuple], got: list[tuple], what: str) -> None:
    for step, ((loss, metrics, grads, norm), (loss2, metrics2, grads2, norm2)) in enumerate(
        zip(ref, got, strict=True)
    ):
        assert (loss, metrics, norm) == (loss2, metrics2, norm2), (what, step)
        assert grads.keys() == grads2.keys() and grads, (what, step)
        for name, grad in grads.items():
            assert torch.equal(grad, grads2[name]), f"{what} step {step}: gradient of {name}"


def _load_quietly(engine, path: Path) -> None:
    """Load a checkpoint saved with the other ``optim.cpu_offload``: a changed config, warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(path)
    assert any("optim.cpu_offload" in str(w.message) for w in caught), caught


def _check_resume_across_the_switch(tmp: Path, batches, rank: int = 0) -> None:
    """Save after ``STEPS`` steps with offload on (and off), load into a fresh engine with it off
    (and on), one more step: the uninterrupted run's state, exactly."""
    for saved_with in (True, False):
        run = _actor(saved_with)
        _run(run, batches[:STEPS])
        path = tmp / f"ckpt_offload{int(saved_with)}"
        run.save_checkpoint(path)
        _run(run, batches[STEPS:])
        expected = _state(run)
        torch.manual_seed(1234 + rank)  # another LoRA initialisation: the checkpoint restores it
        resumed = _actor(not saved_with)
        _load_quietly(resumed, path)
        assert resumed.global_step == STEPS
        _run(resumed, batches[STEPS:])
        _assert_equal_states(expected, _state(resumed), f"saved with cpu_offload={saved_with}")


# ============================================================================ pytest side


@pytest.fixture
def one_process(monkeypatch):
    """The engine starts a process group of one rank for the policy: ended after the test."""
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
def test_one_process_shards_over_one_rank_and_is_exact(tmp_path):
    from torch.distributed.fsdp import FSDPModule

    from microrl.engine import CriticEngine
    from microrl.engine.parallel import distributed as D

    batches = [make_batch(seed=s) for s in range(STEPS + 1)]
    for lora in (0, 4):
        ref = _actor(False, lora)
        assert not isinstance(ref.module, FSDPModule)
        on = _actor(True, lora)
        assert isinstance(on.module, FSDPModule)
        assert on.dp_group is None and not D.is_distributed() and D.world_size() == 1
        for p in on.module.parameters():
            assert p.to_local().device.type == "cpu"
        _assert_equal_runs(_run(ref, batches), _run(on, batches), f"one process, lora={lora}")
        _assert_equal_states(_state(ref), _state(on), f"one process, lora={lora}")
    critics = [
        CriticEngine(tiny_model(), CriticConfig(micro_batch_size=3, optim=_optim(on)))
        for on in (False, True)
    ]
    _assert_equal_runs(*[_run(c, batches) for c in critics], "critic")
    _check_resume_across_the_switch(tmp_path, batches)


def test_config_key_and_incompatible_combinations():
    cfg = load_config(GRPOExampleConfig, None, ["actor.optim.cpu_offload=true"])
    assert cfg.actor.optim.cpu_offload is True and OptimConfig().cpu_offload is False
    with pytest.raises(ValueError, match=r"optim\.cpu_offload.*tensor_parallel_size"):
        load_config(
            GRPOExampleConfig,
            None,
            ["actor.optim.cpu_offload=true", "actor.tensor_parallel_size=2"],
        )
    with pytest.raises(ValueError, match=r"optim\.cpu_offload"):
        OptimConfig(cpu_offload="yes")
    # With sequence parallelism it shards over the dp x sp ranks (tests/engine/
    # test_sequence_parallel.py runs it against one process).
    both = ActorConfig(sequence_parallel_size=2, optim=OptimConfig(cpu_offload=True))
    assert both.optim.cpu_offload and both.sequence_parallel_size == 2


def test_the_policy_pins_memory_on_cuda_only():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from microrl.engine.parallel.cpu_offload import offload_policy

    assert offload_policy(torch.device("cuda", 0)) == CPUOffloadPolicy(pin_memory=True)
    assert offload_policy(torch.device("cpu")) == CPUOffloadPolicy(pin_memory=False)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks(tmp_path):
    (tmp_path / "out").mkdir()
    launch(2, HERE, str(tmp_path))
    passed = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert passed[0] == passed[1], passed
    assert passed[0] == [
        "every_unit_has_the_policy",
        "exact_on_vs_off[lora=0]",
        "exact_on_vs_off[lora=4]",
        "clip_host_shards_is_torchs_clipping",
        "activation_offload_under_fsdp",
        "resume_across_the_switch",
        "rank0_loading",
    ]


# ============================================================================ rank side


def _check_clip_host_shards(engine, batch) -> None:
    """The clipping the engine uses for offloaded gradients on an accelerator's mesh, run on the
    gloo mesh here: the same norm and clipped gradients as ``clip_grad_norm_`` on the DTensors."""
    from microrl.engine.optim import clip_host_shards

    engine.optimizer.zero_grad(set_to_none=True)
    engine.forward_backward_batch(batch)
    params = [p for p in engine.module.parameters() if p.grad is not None]
    original = [p.grad.detach().clone() for p in params]
    for max_norm in (1e-3, float("inf")):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        want = [full_tensor(p.grad).clone() for p in params]
        for p, g in zip(params, original, strict=True):
            p.grad = g.clone()
        got_norm = clip_host_shards(params, max_norm)
        assert abs(got_norm.item() - norm.item()) <= 1e-6 * norm.item(), (got_norm, norm)
        for p, w in zip(params, want, strict=True):
            assert_max_close(full_tensor(p.grad), w, "clip_host_shards", 1e-7)
        for p, g in zip(params, original, strict=True):
            p.grad = g.clone()
    engine.optimizer.zero_grad(set_to_none=True)


def main(tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy

    import microrl.engine.offload as offload
    from microrl.engine import ActorEngine
    from microrl.engine.parallel import distributed as D

    tmp_path = Path(tmp)
    rank = int(os.environ["RANK"])
    batches = [make_batch(seed=s) for s in range(STEPS + 1)]
    mine = [b[SHARDS[rank]] for b in batches]
    offload.MIN_OFFLOAD_BYTES = 0  # every saved tensor qualifies (all are tiny here)
    act_config = actor_config(lora=4, activation_offload=True)

    def references():  # one process, no offload, the whole mini-batches; before any group
        refs = {lora: _run(_actor(False, lora), batches) for lora in (0, 4)}
        engine = ActorEngine(tiny_model(), act_config)
        engine.forward_step(mine[0][:2])[0].backward()  # this rank's first micro-batch
        refs["stats"] = engine.last_offload_stats
        return refs

    refs = single_process(references)
    passed = []

    # ---- every FSDP unit gets the policy (no pinning on the CPU)
    calls = []
    real = D.fully_shard

    def spy(module, **kwargs):
        calls.append(kwargs.get("offload_policy"))
        return real(module, **kwargs)

    D.fully_shard = spy
    try:
        engines = {lora: (_actor(False, lora), _actor(True, lora)) for lora in (0, 4)}
    finally:
        D.fully_shard = real
    units = sum(isinstance(m, D.FSDPModule) for m in engines[0][1].module.modules())
    assert calls.count(CPUOffloadPolicy(pin_memory=False)) == 2 * units, calls
    assert calls.count(None) == 2 * units, calls
    passed.append("every_unit_has_the_policy")

    # ---- on equals off exactly; both equal one process to fp32 summation order
    for lora, (off, on) in engines.items():
        got, ref = _run(on, mine), _run(off, mine)
        _assert_equal_runs(ref, got, f"2 ranks, lora={lora}")
        _assert_equal_states(_state(off), _state(on), f"2 ranks, lora={lora}")
        for (loss, metrics, grads, _), (loss1, metrics1, grads1, _) in zip(
            got, refs[lora], strict=True
        ):
            assert abs(loss - loss1) <= 1e-6
            assert_metrics_close(metrics1, metrics, f"one process, lora={lora}")
            for name, grad in grads1.items():
                assert_max_close(grads[name], grad, f"one process, lora={lora}: {name}", ATOL)
        passed.append(f"exact_on_vs_off[lora={lora}]")

    # ---- the clipping path of offloaded gradients on a GPU mesh, against torch's
    _check_clip_host_shards(_actor(True, 0), mine[0])
    passed.append("clip_host_shards_is_torchs_clipping")

    # ---- activation offload under FSDP2: the same update; the gathered parameters (views of
    # FSDP's all-gather buffers) are kept, so each micro-batch offloads what one process does
    with_offload = ActorEngine(tiny_model(), act_config)
    without = ActorEngine(tiny_model(), actor_config(lora=4))
    loss, _, _ = with_offload.forward_step(mine[0][:2])
    loss.backward()
    stats = with_offload.last_offload_stats
    assert (stats.tensors, stats.bytes) == (refs["stats"].tensors, refs["stats"].bytes), stats
    with_offload.optimizer.zero_grad(set_to_none=True)
    ref, got = _run(without, mine), _run(with_offload, mine)
    for step in got:
        assert step[1].pop("offload/bytes") > 0
    _assert_equal_runs(ref, got, "activation offload under FSDP2")
    passed.append("activation_offload_under_fsdp")

    # ---- exact resume, saved with offload on and loaded with it off, and vice versa
    _check_resume_across_the_switch(tmp_path, mine, rank)
    passed.append("resume_across_the_switch")

    # ---- a checkpoint path under torchrun: rank 0 reads it, the shards land in host memory
    check_rank0_loading(tmp_path, optim=OptimConfig(name="sgd", lr=1.0, cpu_offload=True))
    passed.append("rank0_loading")

    dist.barrier()
    (tmp_path / "out" / f"rank{rank}.json").write_text(json.dumps(passed))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
