"""Several asynchronous ``hf`` workers behind one trainer (microrl/rollout/samplers/hf_pool.py).

- A job's prompts are split into contiguous chunks of whole prompts, one per worker (an empty
  chunk: no job); the rollout comes back in the caller's order, each part exactly the
  ``HFRollout`` sample of its chunk with its part seed, merged into one batch, the log-probs
  the engine's, every row's ``policy_version`` the one pushed before the job.
- Seeds derive from one seed drawn like ``AsyncRollout``'s: a job is reproducible.
- Every sync reaches every worker and is checked by each; a push that leaves a tensor stale on
  one worker fails with an error naming that worker.
- Episodes are split the same way; with ``skip_env_errors`` a part whose rows all failed is
  dropped, and the group ids keep indexing the job's problems.
- ``close`` stops every worker; ``num_workers`` is validated, and 1 is a plain ``AsyncRollout``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import multiprocessing
import os

import pytest
import torch
from hf_worker_utils import (
    PROMPTS,
    SEEDED,
    assert_same,
    make_engine,
    picky_env,
    stale_bytes,
    update,
)

from microrl.rollout import HFRollout, SamplingParams, merge_rollouts
from microrl.rollout.sampler import (
    POLICY_VERSION_KEY,
    Sampler,
    SamplerOptions,
    WorkerError,
)
from microrl.rollout.samplers.hf_pool import (
    AsyncRolloutPool,
    part_seeds,
    split_sizes,
)
from microrl.rollout.samplers.hf_worker import AsyncRollout, warn_if_oversubscribed
from microrl.rollout.weights.sync_check import SyncCheckError
from microrl.tasks import AdditionTask

EPISODE_PARAMS = SamplingParams(num_samples=2, max_new_tokens=4)
EPISODE_LIMITS = dict(max_turns=3, max_tokens=14)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread in the trainer, beside the two workers' one each (2 cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def pool():
    """A LoRA engine and a pool of 2 workers, shared by the module (the last test breaks and
    closes it)."""
    engine, tok = make_engine(lora_rank=4)
    with AsyncRolloutPool(
        engine, tok, SamplerOptions(env_maker=picky_env), num_workers=2
    ) as workers:
        yield engine, tok, workers
    assert not any(w.process.is_alive() for w in workers.workers)


def _expected(model, tok, chunks, params) -> object:
    """What the pool returns for ``chunks`` (the split prompts): each chunk sampled by
    ``HFRollout`` with its part seed, merged."""
    seeds = part_seeds(params.seed, 2)
    parts = [
        HFRollout(model, tok).generate(chunk, dataclasses.replace(params, seed=seed))
        for chunk, seed in zip(chunks, seeds, strict=False)
    ]
    return parts[0] if len(parts) == 1 else merge_rollouts(parts, pad_token_id=tok.pad_token_id)


def _prompt_ids(batch, row: int) -> list[int]:
    """Row ``row``'s prompt tokens: the real ones before the first response column."""
    boundary = int(batch["loss_mask"].any(dim=0).nonzero()[0])
    ids, attention = batch["input_ids"][row, :boundary], batch["attention_mask"][row, :boundary]
    return ids[attention].tolist()


def _check_rows(rollout, tok, prompts, version: int) -> None:
    """Rows grouped by prompt in the caller's order, each answering its own prompt."""
    rows = rollout.batch.batch_size[0]
    assert rows == len(rollout.texts) == len(rollout.group_ids)
    for row, group in enumerate(rollout.group_ids.tolist()):
        assert _prompt_ids(rollout.batch, row) == tok(prompts[group])["input_ids"]
    assert rollout.batch[POLICY_VERSION_KEY].tolist() == [version] * rows


def test_pure_helpers() -> None:
    assert split_sizes(3, 2) == [2, 1] and split_sizes(1, 2) == [1, 0]
    assert split_sizes(8, 3) == [3, 3, 2] and split_sizes(4, 2) == [2, 2]
    seeds = part_seeds(11, 3)
    assert seeds[0] == 11 and seeds == part_seeds(11, 3) and len(set(seeds)) == 3
    assert part_seeds(12, 3)[1:] != seeds[1:] and part_seeds(11, 1) == [11]


def test_a_job_is_split_over_the_workers_in_order(pool) -> None:
    engine, tok, workers = pool
    job = workers.submit(PROMPTS, SEEDED)  # 3 prompts over 2 workers: 2 + 1
    assert [(p.worker, p.start, p.size) for p in job.parts] == [(0, 0, 2), (1, 2, 1)]
    rollout = workers.collect(job)
    assert_same(rollout, _expected(engine, tok, [PROMPTS[:2], PROMPTS[2:]], SEEDED))
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # no group straddles
    _check_rows(rollout, tok, PROMPTS, version=0)
    # The sampler's log-probs are the engine's (float32: rounding only).
    mask = rollout.batch["loss_mask"]
    logprobs = engine.infer_batch(rollout.batch)["logprobs"]
    torch.testing.assert_close(
        logprobs[mask], rollout.batch["rollout_logprobs"][mask], rtol=0, atol=1e-5
    )
    assert len(workers.job_seconds) == len(workers.job_cpu_seconds) >= 1
    # One prompt: the second worker gets no job; the part is HFRollout's sample itself.
    job = workers.submit([PROMPTS[1]], SEEDED)
    assert [(p.worker, p.size) for p in job.parts] == [(0, 1)]
    single = workers.collect(job)
    assert_same(single, HFRollout(engine, tok).generate([PROMPTS[1]], SEEDED))
    assert single.group_ids.tolist() == [0, 0, 0]
    _check_rows(single, tok, [PROMPTS[1]], version=0)


def test_unseeded_jobs_draw_their_seed_from_torch(pool) -> None:
    engine, tok, workers = pool
    params = SamplingParams(num_samples=2, max_new_tokens=4)
    torch.manual_seed(123)
    seed = int(torch.randint(2**31 - 1, ()))  # what AsyncRollout would draw
    torch.manual_seed(123)
    first = workers.generate(PROMPTS, params)
    torch.manual_seed(123)
    again = workers.generate(PROMPTS, params)
    assert_same(first, again)
    chunks = [PROMPTS[:2], PROMPTS[2:]]
    assert_same(first, _expected(engine, tok, chunks, dataclasses.replace(params, seed=seed)))


def test_episodes_are_split_over_the_workers(pool) -> None:
    _, tok, workers = pool
    problems = [AdditionTask.make(1, 2), AdditionTask.make(3, 4), AdditionTask.make(5, 6)]
    rollout = workers.collect(workers.submit_episodes(problems, EPISODE_PARAMS, **EPISODE_LIMITS))
    assert rollout.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    _check_rows(rollout, tok, [p.prompt for p in problems], version=0)
    assert rollout.rewards.shape == (6,) and (rollout.num_turns >= 1).all()
    assert rollout.metrics["episodes/env_errors"] == 0
    # skip_env_errors: a group dropped inside a part keeps its gap; a part whose every row
    # failed (the second worker's 9+1) is dropped, its rows counted.
    bad = AdditionTask.make(9, 1)
    gap = workers.collect(
        workers.submit_episodes(
            [problems[0], bad, problems[1]],
            EPISODE_PARAMS,
            skip_env_errors=True,
            **EPISODE_LIMITS,
        )
    )
    assert gap.group_ids.tolist() == [0, 0, 2, 2]
    _check_rows(gap, tok, [problems[0].prompt, bad.prompt, problems[1].prompt], version=0)
    dropped = workers.collect(
        workers.submit_episodes(
            [*problems[:2], bad], EPISODE_PARAMS, skip_env_errors=True, **EPISODE_LIMITS
        )
    )
    assert dropped.group_ids.tolist() == [0, 0, 1, 1]
    assert dropped.metrics["episodes/env_errors"] == 2
    # Without it, the environment's error comes back, saying which worker and prompts.
    failing = workers.submit_episodes([problems[0], bad], EPISODE_PARAMS, **EPISODE_LIMITS)
    with pytest.raises(Exception, match="no environment for 9\\+1=") as info:
        workers.collect(failing)
    assert "the rollout worker 2 of 2, sampling prompts 1..1" in "".join(info.value.__notes__)
    assert isinstance(workers, Sampler) and not hasattr(workers, "run_episodes")


def test_a_sync_reaches_every_worker(pool) -> None:
    engine, tok, workers = pool
    old = copy.deepcopy(engine.model)
    update(engine, tok)
    stale = workers.submit(PROMPTS, SEEDED)  # queued before the push: the old weights
    workers.sync(engine)
    fresh = workers.submit(PROMPTS, SEEDED)
    assert (stale.version, fresh.version, workers.version) == (0, 1, 1)
    assert [w.version for w in workers.workers] == [1, 1]
    chunks = [PROMPTS[:2], PROMPTS[2:]]
    stale_rollout, fresh_rollout = workers.collect(stale), workers.collect(fresh)
    assert_same(stale_rollout, _expected(old, tok, chunks, SEEDED))
    assert_same(fresh_rollout, _expected(engine, tok, chunks, SEEDED))  # both workers: new weights
    _check_rows(stale_rollout, tok, PROMPTS, version=0)
    _check_rows(fresh_rollout, tok, PROMPTS, version=1)
    for worker in workers.workers:  # each checked each push
        assert set(worker.sync_stats) == {0, 1}
    assert set(workers.sync_stats) == {0, 1} and len(workers.sync_seconds) == 2
    for version, stats in workers.sync_stats.items():
        assert stats["sync/probe_abs_diff_max"] < 1e-5 and 0 <= stats["sync/probe_kl"] < 1e-10
        for key, value in stats.items():
            assert value == max(w.sync_stats[version][key] for w in workers.workers)


def test_a_push_stale_on_one_worker_fails_naming_it_and_close_stops_all(pool, monkeypatch) -> None:
    engine, tok, workers = pool
    name = "model.layers.1.self_attn.q_proj.lora_B.default.weight"
    before = dict(engine.model.named_parameters())[name].detach().clone()
    update(engine, tok)
    broadcast = AsyncRollout._broadcast
    second = workers.workers[1]

    def skipping_one_on_the_second(self, buffer, chunk_bytes):
        if self is second:  # this push "forgets" one tensor
            buffer = stale_bytes(self, buffer, name, before)
        return broadcast(self, buffer, chunk_bytes)

    monkeypatch.setattr(AsyncRollout, "_broadcast", skipping_one_on_the_second)
    version = workers.version + 1
    workers.sync(engine)
    with pytest.raises(SyncCheckError) as info:
        workers.generate(PROMPTS, SEEDED)
    message = str(info.value)
    assert f"policy version {version} (the weights after step {version}) to the rollout " in (
        message
    )
    assert "to the rollout worker 2 of 2 failed its check" in message
    assert f"lora_B of layer 1 self_attn.q_proj ({name})" in message
    assert workers.workers[0].sync_stats[version]["sync/probe_abs_diff_max"] < 1e-5
    assert second.sync_stats[version]["sync/probe_abs_diff_max"] > 1e-4
    processes = [worker.process for worker in workers.workers]
    workers.close()
    for process in processes:
        assert not process.is_alive() and process not in multiprocessing.active_children()
    with pytest.raises(WorkerError, match="the 2 rollout workers are closed"):
        workers.submit(PROMPTS, SEEDED)


def test_oversubscribed_cores_are_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with caplog.at_level(logging.WARNING):
        assert not warn_if_oversubscribed("the rollout worker", [1])  # 1 + 1 on 2 cores
        assert warn_if_oversubscribed("the 2 rollout workers", [1, 1])
    assert "the torch threads of the 2 rollout workers (1 + 1) take 3 threads on 2 cores" in (
        caplog.text
    )
