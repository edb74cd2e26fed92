"""A backend of this process as a ``Sampler`` (microrl/rollout/samplers/in_process.py): a job
samples when it is collected, with the weights synced last; a backend holding a copy of the
weights loads it every ``rollout.sync_every`` versions, or at once for ``current()``."""

from __future__ import annotations

import pytest
import torch

from microrl.rollout import InProcessSampler, RolloutBackend, Sampler, Samples, SamplingParams
from microrl.rollout.sampler import POLICY_VERSION_KEY
from microrl.run.toy_model import build_tokenizer
from microrl.tasks import Problem


class CopyBackend(RolloutBackend):
    """Samples one token per row, drawn from torch's generator, and counts its loads."""

    def __init__(self, holds_weights: bool) -> None:
        super().__init__(build_tokenizer())
        self.holds_weights, self.loads, self.sampled = holds_weights, 0, 0

    def _sample(self, prompt_ids, params) -> Samples:
        self.sampled += 1
        rows = len(prompt_ids) * params.num_samples
        ids = torch.randint(5, 10, (rows, 1)).tolist()
        return Samples(token_ids=ids, logprobs=[[-0.5]] * rows)

    def sync(self, engine) -> None:
        self.loads += 1


class Env:
    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}


PARAMS = SamplingParams(num_samples=2, max_new_tokens=1)


def test_a_job_samples_at_collect_with_torchs_generator_then() -> None:
    sampler = InProcessSampler(CopyBackend(holds_weights=False), engine="engine")
    assert isinstance(sampler, Sampler) and sampler.trainer_thread
    torch.manual_seed(0)
    job = sampler.submit(["1+1=", "2+2="], PARAMS)
    assert sampler.backend.sampled == 0  # nothing sampled before collect
    torch.manual_seed(0)  # what a synchronous loop draws right where it samples
    expected = sampler.backend.generate(["1+1=", "2+2="], PARAMS)
    torch.manual_seed(0)
    rollout = sampler.collect(job)
    assert torch.equal(rollout.batch["input_ids"], expected.batch["input_ids"])
    assert rollout.batch[POLICY_VERSION_KEY].tolist() == [0, 0, 0, 0]


def test_the_live_model_is_always_current_and_a_copy_loads_every_sync_every() -> None:
    live = InProcessSampler(CopyBackend(holds_weights=False), engine="e", version=4, sync_every=3)
    copy = InProcessSampler(CopyBackend(holds_weights=True), engine="e", version=4, sync_every=3)
    versions = []
    for _ in range(4):  # versions 5, 6, 7, 8: the copy loads at 6 (a multiple of 3)
        live.sync()
        copy.sync()
        job = copy.submit(["1+1="], PARAMS)
        versions.append(copy.collect(job).batch[POLICY_VERSION_KEY][0].item())
        assert live.loaded == live.version
    assert versions == [4, 6, 6, 6] and copy.backend.loads == 1
    assert copy.current() is copy.backend and copy.loaded == 8 and copy.backend.loads == 2
    copy.current()  # current already: nothing loaded
    assert copy.backend.loads == 2
    with pytest.raises(ValueError, match=r"rollout\.sync_every"):
        InProcessSampler(CopyBackend(holds_weights=True), engine="e", sync_every=0)


def test_episodes_build_their_environments_at_collect() -> None:
    made = []

    def make_env(problem):
        made.append(problem.prompt)
        return Env()

    sampler = InProcessSampler(CopyBackend(holds_weights=False), engine="e", env_maker=make_env)
    problems = [Problem(prompt="1+1=", answer="2"), Problem(prompt="2+2=", answer="4")]
    job = sampler.submit_episodes(problems, PARAMS, max_turns=2, max_tokens=8)
    assert made == []
    rollout = sampler.collect(job)
    assert made == ["1+1=", "1+1=", "2+2=", "2+2="] and rollout.rewards.tolist() == [1.0] * 4
    assert rollout.group_ids.tolist() == [0, 0, 1, 1] and POLICY_VERSION_KEY in rollout.batch
