"""The asynchronous ``hf`` rollout: a worker process with its own weights (engine/rollout/async_*.py).

- A job samples what ``HFRollout`` samples on the weights of the version pushed last before it
  (LoRA adapters, and a full fine-tune's every weight), and its rows carry that version; a job
  submitted before a push samples the old weights, one after it the new ones.
- Every push is checked: the worker's probe log-probs equal the engine's (``sync_stats``), and
  a push that leaves one tensor stale fails with an error naming the version and the tensor.
- The pair's gloo group never touches torch's default group.
- A worker that hangs or dies is an error naming it, within the timeout; Ctrl-C (SIGINT) is
  the trainer's, not the worker's; ``close`` stops even a stopped worker.
- Multi-turn episodes are played in the worker by a picklable environment factory; an
  environment's error comes back to the trainer.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.run import ModelConfig
from microrl.engine import ActorEngine
from microrl.engine.rollout import HFRollout, SamplingParams
from microrl.engine.rollout.async_rollout import (
    POLICY_VERSION_KEY,
    AsyncRollout,
    SyncCheckError,
    WorkerError,
)
from microrl.losses import broadcast_to_tokens
from microrl.run.toy_model import build_model, build_tokenizer
from microrl.tasks import AdditionTask, HintedAdditionTask

PROMPTS = ["1+2=", "34+5=", "7+8="]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread in the trainer, as the recipes run it beside the worker (which has
    one): two OpenMP threads spinning against the worker's on 2 cores slow a step 100x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


SEEDED = SamplingParams(num_samples=3, max_new_tokens=4, seed=11)


def _engine(lora_rank: int = 4) -> tuple[ActorEngine, object]:
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2), tok
    )
    config = ActorConfig(
        lora=LoraConfig(rank=lora_rank), micro_batch_size=16, optim=OptimConfig(lr=5e-2)
    )
    return ActorEngine(model, config), tok


def _update(engine: ActorEngine, tok) -> None:
    """One optimizer step on a rollout with random advantages: every trained tensor moves."""
    rollout = HFRollout(engine, tok).generate(PROMPTS * 2, SamplingParams(num_samples=4))
    batch = rollout.batch
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    advantages = torch.randn(batch.batch_size[0], generator=torch.Generator().manual_seed(1))
    batch["advantages"] = broadcast_to_tokens(advantages, batch["loss_mask"])
    engine.train_batch(batch)


def _same(rollout, reference) -> None:
    assert torch.equal(rollout.batch["input_ids"], reference.batch["input_ids"])
    assert torch.equal(rollout.batch["loss_mask"], reference.batch["loss_mask"])
    torch.testing.assert_close(
        rollout.batch["rollout_logprobs"], reference.batch["rollout_logprobs"], rtol=0, atol=1e-5
    )
    assert rollout.texts == reference.texts


@pytest.fixture(scope="module")
def lora_worker():
    """A LoRA engine and its worker, shared by the next two tests (the second breaks it)."""
    engine, tok = _engine(lora_rank=4)
    with AsyncRollout(engine, tok) as worker:
        yield engine, tok, worker
    assert not worker.process.is_alive()


def _check_versions(engine, tok, worker) -> None:
    assert not dist.is_initialized()  # the pair's group is not torch's default group
    first = worker.generate(PROMPTS, SEEDED)
    _same(first, HFRollout(engine, tok).generate(PROMPTS, SEEDED))
    assert first.batch[POLICY_VERSION_KEY].tolist() == [0] * 9
    old = copy.deepcopy(engine.model)
    _update(engine, tok)
    stale = worker.submit(PROMPTS, SEEDED)  # queued before the push: the old weights
    worker.sync(engine)
    fresh = worker.submit(PROMPTS, SEEDED)
    assert (stale.version, fresh.version, worker.version) == (0, 1, 1)
    stale_rollout, fresh_rollout = worker.collect(stale), worker.collect(fresh)
    _same(stale_rollout, HFRollout(old, tok).generate(PROMPTS, SEEDED))
    _same(fresh_rollout, HFRollout(engine, tok).generate(PROMPTS, SEEDED))
    assert fresh_rollout.batch[POLICY_VERSION_KEY].tolist() == [1] * 9
    # The update moved the policy: the stale rows' log-probs are not the current ones.
    now = engine.infer_batch(stale_rollout.batch)["logprobs"]
    assert (now - stale_rollout.batch["rollout_logprobs"]).abs().max() > 1e-3
    assert set(worker.sync_stats) == {0, 1}
    for stats in worker.sync_stats.values():  # float32: the two forwards agree to rounding
        assert stats["sync/probe_abs_diff_max"] < 1e-5
        assert 0 <= stats["sync/probe_kl"] < 1e-10
    assert not dist.is_initialized()


def test_lora_jobs_sample_the_version_pushed_before_them(lora_worker) -> None:
    _check_versions(*lora_worker)


def test_full_fine_tune_jobs_sample_the_version_pushed_before_them() -> None:
    engine, tok = _engine(lora_rank=0)
    with AsyncRollout(engine, tok) as worker:
        _check_versions(engine, tok, worker)
    assert not worker.process.is_alive()


def test_a_push_that_leaves_a_tensor_stale_fails_its_check(lora_worker, monkeypatch) -> None:
    engine, tok, worker = lora_worker
    name = "model.layers.1.self_attn.q_proj.lora_B.default.weight"
    before = dict(engine.model.named_parameters())[name].detach().clone()
    _update(engine, tok)
    broadcast = AsyncRollout._broadcast

    def skipping_one(self, state, entries):  # the push "forgets" one tensor
        return broadcast(self, {**state, name: before}, entries)

    monkeypatch.setattr(AsyncRollout, "_broadcast", skipping_one)
    version = worker.version + 1
    worker.sync(engine)
    with pytest.raises(SyncCheckError) as info:
        worker.generate(PROMPTS, SEEDED)
    message = str(info.value)
    assert f"policy version {version} (the weights after step {version})" in message
    assert f"lora_B of layer 1 self_attn.q_proj ({name})" in message
    assert "rollout.sync_check_tol" in message
    # The probe sees it too, far above the float32 tolerance.
    assert worker.sync_stats[version]["sync/probe_abs_diff_max"] > 1e-4


def test_a_hung_worker_is_an_error_naming_it_and_close_never_hangs() -> None:
    engine, tok = _engine()
    worker = AsyncRollout(engine, tok)
    worker.timeout_s = 3  # (after the start, which a loaded machine may make slow)
    pid = worker.process.pid
    os.kill(pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    assert worker.generate(PROMPTS, SEEDED).texts  # the worker ignored it
    os.kill(pid, signal.SIGSTOP)  # hangs
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"the rollout worker \(pid \d+\) sent nothing for 3 s"):
        worker.generate(PROMPTS, SEEDED)
    assert time.monotonic() - start < 10
    start = time.monotonic()
    worker.close()  # no answer to "close": terminated
    assert time.monotonic() - start < 15
    assert not worker.process.is_alive() and worker.process not in multiprocessing.active_children()
    with pytest.raises(WorkerError, match="is closed"):
        worker.submit(PROMPTS, SEEDED)


def picky_env(problem):
    """A picklable environment factory (by reference): hinted addition, but not for 9+..."""
    if problem.prompt.startswith("9+"):
        raise RuntimeError(f"no environment for {problem.prompt}")
    return HintedAdditionTask(9, 8).make_env(problem)


def test_episodes_are_played_in_the_worker() -> None:
    engine, tok = _engine()
    with pytest.raises(ValueError, match="env_maker cannot be sent to the rollout worker"):
        AsyncRollout(engine, tok, env_maker=lambda problem: None)
    problems = [AdditionTask.make(1, 2), AdditionTask.make(3, 4)]
    params = SamplingParams(num_samples=2, max_new_tokens=4)
    with AsyncRollout(engine, tok, env_maker=picky_env) as worker:
        with pytest.raises(TypeError, match="submit_episodes"):
            worker.run_episodes(["1+2="], picky_env, params, max_turns=3, max_tokens=14)
        job = worker.submit_episodes(problems, params, max_turns=3, max_tokens=14)
        rollout = worker.collect(job)
        assert rollout.batch.batch_size[0] == 4 and rollout.group_ids.tolist() == [0, 0, 1, 1]
        assert rollout.rewards is not None and ((rollout.num_turns >= 1).all())
        assert rollout.batch[POLICY_VERSION_KEY].tolist() == [0] * 4
        failing = worker.submit_episodes(
            [AdditionTask.make(9, 1)], params, max_turns=3, max_tokens=14
        )
        with pytest.raises(Exception, match="no environment for 9\\+1="):
            worker.collect(failing)
        # A failed job leaves the worker serving the next one.
        assert worker.collect(worker.submit_episodes(problems, params, max_turns=3, max_tokens=14))
        os.kill(worker.process.pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"rollout worker \(pid \d+\) died with exit code -9"):
            worker.generate(PROMPTS, SEEDED)
    assert worker.process not in multiprocessing.active_children()
