"""Every sampler is a ``Sampler`` (microrl/rollout/sampler.py), and composes a rollout backend
instead of being one (nor another sampler): no method refuses what its base class offers."""

from __future__ import annotations

import inspect
import typing

import pytest

from microrl.rollout import (
    AsyncRollout,
    AsyncRolloutPool,
    InProcessSampler,
    RolloutBackend,
    Sampler,
    VLLMServerRollout,
)
from microrl.rollout.samplers.sp_group import SPGroupSampler
from microrl.run.source import RolloutSource

METHODS = ("submit", "submit_episodes", "collect", "poll", "sync", "close")
SAMPLERS = (AsyncRollout, AsyncRolloutPool, VLLMServerRollout, SPGroupSampler, InProcessSampler)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda c: c.__name__)
def test_each_sampler_has_the_protocols_methods_with_its_signatures(sampler) -> None:
    assert not issubclass(sampler, RolloutBackend)
    for name in METHODS:
        declared = inspect.signature(getattr(Sampler, name))
        actual = inspect.signature(getattr(sampler, name))
        for parameter in declared.parameters.values():  # the protocol's, by name and kind
            assert parameter.name in actual.parameters, (sampler.__name__, name, parameter)
            assert actual.parameters[parameter.name].kind == parameter.kind, (name, parameter)
        extra = [p for p in actual.parameters.values() if p.name not in declared.parameters]
        assert all(p.default is not inspect.Parameter.empty for p in extra), (name, extra)


def test_samplers_compose_and_never_subclass_each_other() -> None:
    from microrl.agents.agent_sampler import AgentSampler

    samplers = (*SAMPLERS, AgentSampler)
    pairs = [(a, b) for a in samplers for b in samplers if a is not b and issubclass(a, b)]
    assert not pairs, pairs


def test_a_sampler_missing_a_method_cannot_be_built_and_the_interface_names_its_data() -> None:
    class Partial(Sampler):
        def submit(self, prompts, params, *, images=None): ...

    with pytest.raises(TypeError, match="collect"):
        Partial()
    hints = typing.get_type_hints(Sampler)
    assert set(hints) >= {"version", "sync_stats", "trainer_thread", "samples_at_collect"}
    for sampler in SAMPLERS:
        assert issubclass(sampler, Sampler)


def test_the_rollout_source_is_typed_on_the_protocol() -> None:
    hints = typing.get_type_hints(RolloutSource.__init__)
    assert hints["sampler"] is Sampler
