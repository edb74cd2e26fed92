"""The ``hf`` generation worker killed at each point: a bounded stop with a clear message, and
an exact ``--resume``.

- Killed in the middle of a message: ``WorkerError`` with its exit code within seconds (a reader
  of a ``multiprocessing.Queue`` waited for the rest of the message for ever).
- Killed while its job is in flight, then killed during a weight push: each run stops at the
  next wait for the worker, naming it; each ``--resume`` continues from the last checkpoint, and
  the steps trained in all equal the uninterrupted run's, once each.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time

import pytest
import torch
from example_utils import async_run_args
from fault_utils import by_step, checkpoint_step, dies_while_its_error_is_sent, run

from microrl.configs import ActorConfig, LoraConfig
from microrl.configs.run import ModelConfig
from microrl.engine import ActorEngine
from microrl.rollout import SamplingParams
from microrl.rollout.sampler import SamplerOptions, WorkerError
from microrl.rollout.samplers.hf_worker import AsyncRollout
from microrl.run import StepFailed
from microrl.run.toy_model import build_model, build_tokenizer
from microrl.tasks import AdditionTask


def _tiny_engine() -> tuple[ActorEngine, object]:
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1), tok)
    return ActorEngine(model, ActorConfig(lora=LoraConfig(rank=2))), tok


@pytest.mark.timeout(120)  # the old channel hung here for ever: a failure, not a stuck suite
def test_a_worker_killed_mid_message_is_an_error_within_seconds() -> None:
    engine, tok = _tiny_engine()
    options = SamplerOptions(env_maker=dies_while_its_error_is_sent, num_threads=1)
    with AsyncRollout(engine, tok, options) as worker:
        params = SamplingParams(num_samples=1, max_new_tokens=4)
        job = worker.submit_episodes([AdditionTask.make(1, 2)], params, max_turns=1, max_tokens=8)
        worker.process.join(60)  # it died sending its 4 MiB error; nothing was read meanwhile
        assert worker.process.exitcode == 9
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            worker.collect(job)
        assert time.monotonic() - start < 10
    assert str(info.value) == (
        f"the rollout worker (pid {worker.process.pid}) died with exit code 9 while the trainer "
        "waited for the rollout of job 0 (policy version 0)"
    )


def _kill_worker_after(monkeypatch, method: str, when, kills: list[float]) -> None:
    """SIGKILL the worker right after ``AsyncRollout.<method>`` returns, once, when
    ``when(result, *args)``; ``kills`` gets the time of the kill."""
    original = getattr(AsyncRollout, method)

    def killing(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not kills and when(result, *args):
            os.kill(self.process.pid, signal.SIGKILL)
            kills.append(time.monotonic())
        return result

    monkeypatch.setattr(AsyncRollout, method, killing)


STEPS = 6


@pytest.mark.slow  # four runs, each with its worker: the uninterrupted one, two faulted, the end
def test_a_run_whose_worker_dies_stops_at_once_and_resumes_exactly(tmp_path, monkeypatch):
    common = [
        *[a for a in async_run_args(tmp_path) if not a.startswith("train.steps=")],
        "rollout.max_staleness=1", "output.save_every=1", f"train.steps={STEPS}",
    ]  # fmt: skip
    with monkeypatch.context() as patch:
        full, code = run([*common, f"output.dir={tmp_path / 'full'}"], patch)
    assert code == 0 and len(full) == STEPS
    out = tmp_path / "faulted"
    args = [*common, f"output.dir={out}"]
    trained = []
    for method, when, saved in (
        ("_submit", lambda job, *args: job.id == 4, 2),  # while job 4 (step 5's) is sampled
        ("push_version", lambda _, engine, state, version, *rest: version == 4, 3),  # mid-push
    ):
        kills: list[float] = []
        with monkeypatch.context() as patch:
            _kill_worker_after(patch, method, when, kills)
            steps, stopped = run([*args, "--resume"] if trained else args, patch)
            assert not multiprocessing.active_children()
        assert time.monotonic() - kills[0] < 30  # stopped at the next wait, not after timeout_s
        assert isinstance(stopped, StepFailed) and isinstance(stopped.error, WorkerError)
        assert re.fullmatch(
            r"the rollout worker \(pid \d+\) died with exit code -9 while the trainer waited for .*",
            str(stopped.error),
        )
        # The save after the kill waited for the rollouts sampled ahead: the one before stays.
        assert checkpoint_step(out) == saved
        trained += steps[: saved - len(trained)]
    with monkeypatch.context() as patch:
        steps, code = run([*args, "--resume"], patch)
    assert code == 0
    assert [*trained, *steps] == full
    assert by_step(out) == by_step(tmp_path / "full")
