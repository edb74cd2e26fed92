"""The one place a sampler is picked (microrl/rollout/factory.py): ``make_sampler`` from the
rollout config, in this process at ``rollout.max_staleness=0``, in processes of its own above."""

from __future__ import annotations

import pytest
from hf_worker_utils import make_engine

from microrl.configs.run import RolloutConfig
from microrl.rollout import HFRollout, InProcessSampler, make_sampler
from microrl.rollout.samplers import hf_pool, hf_worker
from microrl.rollout.samplers.hf_pool import check_num_workers


def test_staleness_0_samples_in_this_process_with_the_backend_named() -> None:
    engine, tok = make_engine()
    rollout = RolloutConfig(max_staleness=0, sync_every=2)
    sampler = make_sampler(engine, tok, rollout, version=5, env_maker=len)
    assert isinstance(sampler, InProcessSampler) and isinstance(sampler.backend, HFRollout)
    assert (sampler.version, sampler.sync_every, sampler.env_maker) == (5, 2, len)


def test_staleness_above_0_starts_one_worker_or_a_pool(monkeypatch) -> None:
    class Stub:  # no process: only which class the factory builds, with what
        def __init__(self, *args, **kwargs) -> None:
            self.args, self.kwargs = args, kwargs

    monkeypatch.setattr(hf_worker, "AsyncRollout", Stub)
    monkeypatch.setattr(hf_pool, "AsyncRolloutPool", Stub)
    one = make_sampler("engine", "tok", RolloutConfig(max_staleness=1), version=3)
    assert one.args[:2] == ("engine", "tok") and one.args[2].version == 3 and one.kwargs == {}
    two = make_sampler("engine", "tok", RolloutConfig(max_staleness=2, num_workers=2), version=0)
    assert two.kwargs == {"num_workers": 2}
    with pytest.raises(TypeError, match="RolloutConfig"):
        make_sampler("engine", "tok", {"max_staleness": 1}, version=0)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_workers"):
            check_num_workers(bad)


@pytest.mark.parametrize(
    ("lora", "refused"),
    [
        ({}, "the full weights"),
        (dict(rank=4, target_parameters=["experts.gate_up_proj"]), "adapters on the experts"),
        (dict(rank=4, target_modules=["q_proj", "v_proj"]), None),
    ],
)
def test_vllm_is_refused_the_pushes_of_fused_experts(lora, refused) -> None:
    """A mixture of experts' full push to vLLM failed its sync probe at the first push (vLLM's
    loader does not map transformers' fused expert tensors): refused at start by key; an
    adapter on the attention alone syncs as any adapter."""
    from moe_utils import tiny_moe

    from microrl.configs.engine import ActorConfig, LoraConfig
    from microrl.engine import ActorEngine
    from microrl.rollout.factory import check_vllm_takes_the_experts

    engine = ActorEngine(tiny_moe(), ActorConfig(lora=LoraConfig(**lora)))
    if refused is None:
        check_vllm_takes_the_experts(engine)
        return
    with pytest.raises(ValueError, match=rf"rollout\.backend=vllm .*{refused}"):
        make_sampler(engine, None, RolloutConfig(backend="vllm"), version=0)
