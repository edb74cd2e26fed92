"""A new backend is one ``Sampler`` plus one ``WeightSync`` (docs/rollouts.md#a-new-backend).

The stand-in below is a whole backend, written against the interfaces only: a sampler holding a
copy of the policy that samples a job with the weights of the version pushed last before it
(as a server busy with earlier jobs would), and a weight sync that hands it each version's
trainable tensors, checked on the probe. The rollout source drives it unchanged, synchronously
(``k = 0``: it samples exactly what the live engine samples) and ahead (``k = 1``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random

import torch
from hf_worker_utils import make_engine, update

from microrl.rollout import HFRollout, Rollout, SamplingParams
from microrl.rollout.base import draw_seed
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, Sampler, SamplerOptions
from microrl.rollout.weights.sync_check import engine_probe
from microrl.rollout.weights.weight_sync import ProbeVerifier, WeightSync
from microrl.run import RolloutSource
from microrl.tasks import AdditionTask

PARAMS = SamplingParams(num_samples=2, max_new_tokens=3)


class SnapshotSync(WeightSync):
    """The stand-in's ``WeightSync``: a version's trainable tensors, cloned, checked on the
    probe against the engine's log-probs at the push."""

    def __init__(self, sampler: CopySampler) -> None:
        self.sampler = sampler

    def push(self, engine, version: int) -> None:
        sampler = self.sampler
        trained = {
            n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad
        }
        sampler.versions[version] = trained
        verifier = ProbeVerifier.of(sampler)
        actual = verifier.layout(sampler.score(version, verifier.rows()))
        verifier.verify(version, "the stand-in", verifier.expected(engine), actual, "copied")


class CopySampler(Sampler):
    """The stand-in's ``Sampler``: a copy of the policy; a job samples, when collected, with the
    weights of its version (each a snapshot of the trainable tensors)."""

    def __init__(self, engine, tokenizer, options: SamplerOptions) -> None:
        self._take_options(engine, options)
        self.tokenizer, self.engine = tokenizer, engine
        self.model = copy.deepcopy(engine.model)
        self.backend = HFRollout(self.model, tokenizer)
        self.probe, self.sync_stats = engine_probe(engine, tokenizer), {}
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.jobs: dict[int, tuple] = {}
        self._ids = itertools.count()
        self.weight_sync = SnapshotSync(self)
        self.weight_sync.push(engine, self.version)

    def submit(self, prompts, params, *, images=None) -> Job:
        job = Job(next(self._ids), self.version, "generate")
        seeded = dataclasses.replace(params, seed=draw_seed(params))  # drawn now, in order
        self.jobs[job.id] = (list(prompts), seeded)
        return job

    def collect(self, job: Job) -> Rollout:
        prompts, params = self.jobs.pop(job.id)
        self.last_params = params
        self._load(job.version)
        rollout = self.backend.generate(prompts, params)
        rows = len(rollout.texts)
        rollout.batch[POLICY_VERSION_KEY] = torch.full((rows,), job.version, dtype=torch.long)
        return rollout

    def score(self, version: int, rows: list[list[int]]) -> list[list[float]]:
        """The copy's log-probs of each row's tokens after its first, at temperature 1."""
        self._load(version)
        with torch.no_grad():
            out = []
            for row in rows:
                logits = self.model(input_ids=torch.tensor([row])).logits[0, :-1].float()
                picked = logits.log_softmax(-1).gather(1, torch.tensor(row[1:])[:, None])
                out.append(picked.squeeze(1).tolist())
        return out

    def _load(self, version: int) -> None:
        tensors = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in self.versions[version].items():
                tensors[name].copy_(value)

    def sync(self, engine=None) -> None:
        self.version += 1
        self.weight_sync.push(engine or self.engine, self.version)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        self.jobs.clear()


def _run(k: int, steps: int = 3):
    """The recipe's loop on the stand-in: the prompts, rollouts and seeds of each step."""
    torch.manual_seed(0)
    engine, tok = make_engine()
    sampler = CopySampler(engine, tok, SamplerOptions(version=0))
    source = RolloutSource(
        sampler, AdditionTask(9, 8), PARAMS, random.Random(3), 2, max_staleness=k, last_step=steps
    )
    trained = []
    for step in range(1, steps + 1):
        problems, rollout, _, metrics = source.take(step)
        trained.append([p.prompt for p in problems])
        if k:
            assert metrics["staleness/max"] == min(k, step - 1)
        else:  # synchronous: exactly what the live engine samples, with the job's seed
            prompts = [p.prompt for p in problems]
            live = HFRollout(engine, tok).generate(prompts, sampler.last_params)
            assert metrics == {} and torch.equal(
                live.batch["input_ids"], rollout.batch["input_ids"]
            )
        update(engine, tok)
        source.sync(engine)
    source.close()
    return trained, sampler


def test_a_stand_in_backend_runs_synchronously_and_ahead() -> None:
    sync, sync_sampler = _run(0)
    ahead, ahead_sampler = _run(1)
    assert sync == ahead  # the same prompts, in the same order, for every k
    for sampler in (sync_sampler, ahead_sampler):  # every push was checked
        assert set(sampler.sync_stats) == set(sampler.versions)
        assert all(s["sync/probe_abs_diff_mean"] < 5e-5 for s in sampler.sync_stats.values())
