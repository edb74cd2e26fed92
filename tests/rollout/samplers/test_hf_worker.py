"""The asynchronous ``hf`` rollout: a worker process with its own weights (microrl/rollout/samplers/hf_worker.py, microrl/rollout/worker/).

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
import math
import multiprocessing
import os
import signal
import time
import types

import pytest
import torch
import torch.distributed as dist
from hf_worker_utils import (
    PROMPTS,
    SEEDED,
    assert_same,
    benchmark_module,
    make_engine,
    picky_env,
    stale_bytes,
    update,
)

from microrl.configs import ActorConfig, LoraConfig
from microrl.configs.run import ModelConfig
from microrl.engine import ActorEngine
from microrl.rollout import HFRollout, SamplingParams, watcher
from microrl.rollout.sampler import (
    POLICY_VERSION_KEY,
    Sampler,
    SamplerOptions,
    WorkerError,
)
from microrl.rollout.samplers.hf_worker import AsyncRollout
from microrl.rollout.weights.sync_check import (
    FP32_SYNC_CHECK_TOL,
    LOW_PRECISION_SYNC_CHECK_TOL,
    SYNC_CHECK_STAT,
    SyncCheckError,
    build_probe,
    default_sync_check_tol,
    probe_stats,
)
from microrl.rollout.worker import stream
from microrl.run.toy_model import build_model, build_tokenizer
from microrl.tasks import AdditionTask

LiveBytes = benchmark_module("live_bytes").LiveBytes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread in the trainer, as the recipes run it beside the worker (which has
    one): two OpenMP threads spinning against the worker's on 2 cores slow a step 100x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def lora_worker():
    """A LoRA engine and its worker, shared by the next two tests (the second breaks it)."""
    engine, tok = make_engine(lora_rank=4)
    with AsyncRollout(engine, tok) as worker:
        # Watched from its start: killed if the trainer is (tests/rollout/test_watcher.py).
        assert ("process", worker.process.pid) in watcher.watched()
        yield engine, tok, worker
    assert not worker.process.is_alive()
    assert ("process", worker.process.pid) not in watcher.watched()


def _check_versions(engine, tok, worker) -> None:
    assert not dist.is_initialized()  # the pair's group is not torch's default group
    first = worker.generate(PROMPTS, SEEDED)
    assert_same(first, HFRollout(engine, tok).generate(PROMPTS, SEEDED))
    assert first.batch[POLICY_VERSION_KEY].tolist() == [0] * 9
    old = copy.deepcopy(engine.model)
    update(engine, tok)
    stale = worker.submit(PROMPTS, SEEDED)  # queued before the push: the old weights
    worker.sync(engine)
    fresh = worker.submit(PROMPTS, SEEDED)
    assert (stale.version, fresh.version, worker.version) == (0, 1, 1)
    stale_rollout, fresh_rollout = worker.collect(stale), worker.collect(fresh)
    assert_same(stale_rollout, HFRollout(old, tok).generate(PROMPTS, SEEDED))
    assert_same(fresh_rollout, HFRollout(engine, tok).generate(PROMPTS, SEEDED))
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


def test_full_fine_tune_jobs_sample_the_version_pushed_before_them(monkeypatch) -> None:
    """Pushes in chunks of a tenth of the model: the start streams it (the trainer never holds
    a host copy of the whole model: it held two before, 45 GB for a 7B in bf16 with the
    worker's), and every push still lands exactly (the checks and the rollouts)."""
    engine, tok = make_engine(lora_rank=0, hidden_size=256)  # 2.2 MB: above the probe's bytes
    model = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    monkeypatch.setattr(stream, "CHUNK_BYTES", model // 10)
    monkeypatch.setattr(stream, "_CHECKSUM_ELEMENTS", 2**14)  # its float64 slices, as scaled
    with LiveBytes() as start:
        worker = AsyncRollout(engine, tok)
    with worker:
        # Two chunks, one tensor's checksum slices, the probe's forward: far below a copy.
        assert start.peak < 0.5 * model, start.peak / model
        _check_versions(engine, tok, worker)
    assert not worker.process.is_alive()


def test_a_push_that_leaves_a_tensor_stale_fails_its_check(lora_worker, monkeypatch) -> None:
    engine, tok, worker = lora_worker
    name = "model.layers.1.self_attn.q_proj.lora_B.default.weight"
    before = dict(engine.model.named_parameters())[name].detach().clone()
    update(engine, tok)
    broadcast = AsyncRollout._broadcast

    def skipping_one(self, buffer, chunk_bytes):  # the push "forgets" one tensor
        return broadcast(self, stale_bytes(self, buffer, name, before), chunk_bytes)

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
    engine, tok = make_engine()
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


def test_episodes_are_played_in_the_worker() -> None:
    engine, tok = make_engine()
    with pytest.raises(ValueError, match="env_maker cannot be sent to the rollout worker"):
        AsyncRollout(engine, tok, SamplerOptions(env_maker=lambda problem: None))
    problems = [AdditionTask.make(1, 2), AdditionTask.make(3, 4)]
    params = SamplingParams(num_samples=2, max_new_tokens=4)
    with AsyncRollout(engine, tok, SamplerOptions(env_maker=picky_env)) as worker:
        assert isinstance(worker, Sampler) and not hasattr(worker, "run_episodes")
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


# ----------------------------------------------------------------- the check's statistic
def test_probe_stats_equal_a_float64_hand_computation() -> None:
    gen = torch.Generator().manual_seed(0)
    expected = -10 * torch.rand(4, 16, generator=gen)
    actual = expected + 0.3 * torch.randn(4, 16, generator=gen)
    mask = torch.rand(4, 16, generator=gen) < 0.7
    pairs = [
        (float(e), float(a))
        for e, a, m in zip(expected.flatten(), actual.flatten(), mask.flatten(), strict=True)
        if m
    ]
    diffs = [e - a for e, a in pairs]
    stats = probe_stats(expected, actual, mask)
    assert stats[SYNC_CHECK_STAT] == pytest.approx(sum(abs(d) for d in diffs) / len(diffs), 1e-12)
    assert stats["sync/probe_abs_diff_max"] == pytest.approx(max(abs(d) for d in diffs), 1e-12)
    k3 = sum(math.exp(d) - 1 - d for d in diffs) / len(diffs)
    assert stats["sync/probe_kl"] == pytest.approx(k3, 1e-12)
    assert SYNC_CHECK_STAT == "sync/probe_abs_diff_mean"


def _probe_logprobs(probe, logits: torch.Tensor) -> torch.Tensor:
    """Token-aligned log-probs ``[B, T]`` of the probe's tokens under ``logits`` ``[B, T, V]``."""
    ids = probe["input_ids"]
    out = torch.zeros(ids.shape, dtype=torch.float64)
    out[:, 1:] = logits[:, :-1].double().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.where(probe["loss_mask"], out, 0.0)


def _bare_worker(tol: float, expected: torch.Tensor, probe) -> AsyncRollout:
    """An AsyncRollout with no process, holding what ``_verify`` reads: one push (version 1)
    of one tensor, whose checksum the worker matches."""
    worker = AsyncRollout.__new__(AsyncRollout)
    worker.name, worker.probe, worker.sync_check_tol, worker.sync_stats = (
        "the worker",
        probe,
        tol,
        {},
    )
    worker._expected = {1: (expected, {"w": (1.0, 2.0, 3.0)})}
    return worker


def test_bf16_rounding_passes_the_low_precision_check_and_a_stale_sampler_fails_it() -> None:
    """The sampler's logits rounded to bf16 (|logit| up to ~25, rounded by up to 0.06) against
    the trainer's float32 ones: many tokens differ by a few 1e-2, the largest by more than the
    old 5e-2 bound on the max; the check bounds their mean and passes. A sampler whose weights
    are far behind (a push that did not land) still fails, naming the statistic."""
    tok = build_tokenizer()
    probe = build_probe(512, 64, tok)
    gen = torch.Generator().manual_seed(0)
    # Largest logit ~21 per position, as a trained LM's: bf16 rounds it by up to 0.0625.
    logits = 7 * torch.randn(*probe["input_ids"].shape, 512, generator=gen)
    expected = _probe_logprobs(probe, logits).float()
    rounded = _probe_logprobs(probe, logits.bfloat16().float()).float()
    worker = _bare_worker(LOW_PRECISION_SYNC_CHECK_TOL, expected, probe)
    push = worker._expected[1]
    worker._verify(1, rounded, {"w": (1.0, 2.0, 3.0)})
    stats = worker.sync_stats[1]
    assert stats["sync/probe_abs_diff_max"] > 5e-2  # the old check (max <= 5e-2) failed here
    assert 1e-2 < stats[SYNC_CHECK_STAT] < LOW_PRECISION_SYNC_CHECK_TOL / 4
    # The worst bf16 sampler measured (bf16 weights, 16 layers; benchmarks/README.md): mean
    # |d| 0.1.
    noise = torch.randn(expected.shape, generator=gen)
    noise = noise * 0.1 / noise[probe["loss_mask"]].abs().mean()
    worker._expected[2] = push
    worker._verify(2, expected + noise, {"w": (1.0, 2.0, 3.0)})
    # A sampler far behind: the trainer's policy moved ~0.3 nats per token since.
    behind = _probe_logprobs(probe, logits + 0.5 * torch.randn(logits.shape, generator=gen))
    worker._expected[3] = push
    with pytest.raises(SyncCheckError) as info:
        worker._verify(3, behind.float(), {"w": (1.0, 2.0, 3.0)})
    message = str(info.value)
    assert f"on average ({SYNC_CHECK_STAT}, the mean |difference|" in message
    assert f"tolerance {LOW_PRECISION_SYNC_CHECK_TOL:g}, rollout.sync_check_tol" in message
    assert "every tensor's checksum agrees" in message
    assert worker.sync_stats[3][SYNC_CHECK_STAT] > LOW_PRECISION_SYNC_CHECK_TOL


def test_default_tolerances_follow_the_engine_precision() -> None:
    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    for dtype, base, tol in [
        ("float32", "float32", FP32_SYNC_CHECK_TOL),
        ("auto", "float32", FP32_SYNC_CHECK_TOL),  # no autocast on a CPU
        ("bfloat16", "float32", LOW_PRECISION_SYNC_CHECK_TOL),
        ("float32", "bfloat16", LOW_PRECISION_SYNC_CHECK_TOL),
    ]:
        config = ActorConfig(dtype=dtype, base_dtype=base, lora=LoraConfig(rank=2))
        engine = ActorEngine(copy.deepcopy(model), config)
        assert default_sync_check_tol(engine) == tol, (dtype, base)


# ----------------------------------------------------------------- the worker's precision
def test_the_worker_spec_carries_the_engine_precision(monkeypatch) -> None:
    """The spec carries the engine's base dtype and autocast; the worker builds its model with
    the base in that dtype (never fp32 first; the adapters fp32, as the engine's) and samples
    and scores the probe under that autocast. A float32 engine's worker runs neither."""
    from microrl.rollout.samplers import hf_worker
    from microrl.rollout.worker.main import build_sampler, score_probe

    specs = []

    class NoProcess:  # records the spec the worker would get
        pid, exitcode = 0, None

        def __init__(self, target, args, **kwargs) -> None:
            specs.append(args[0])

        def start(self) -> None:
            pass

        def is_alive(self) -> bool:
            return False

        def join(self, timeout=None) -> None:
            pass

    spawn = multiprocessing.get_context("spawn")
    context = types.SimpleNamespace(
        Pipe=spawn.Pipe, get_start_method=spawn.get_start_method, Process=NoProcess
    )
    monkeypatch.setattr(hf_worker.mp, "get_context", lambda method: context)
    for name in ("watch", "release"):  # no process to watch
        monkeypatch.setattr(hf_worker.watcher, name, lambda *args, **kwargs: None)
    tok = build_tokenizer()
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tok
    )
    for dtype, base in [("bfloat16", "bfloat16"), ("float32", "float32")]:
        config = ActorConfig(dtype=dtype, base_dtype=base, lora=LoraConfig(rank=2))
        engine = ActorEngine(copy.deepcopy(model), config)
        AsyncRollout(engine, tok, wait=False, check_threads=False).close()
    low, full = specs
    assert (low.base_dtype, low.autocast_dtype) == (torch.bfloat16, torch.bfloat16)
    assert (full.base_dtype, full.autocast_dtype) == (torch.float32, None)

    sampler = build_sampler(low)
    dtypes = {n: p.dtype for n, p in sampler.model.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.self_attn.q_proj.lora_A.default.weight"] == torch.float32
    seen = []
    sampler.model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.is_autocast_enabled("cpu"))
    )
    score_probe(sampler.model, low.probe, 1.0, low.autocast_dtype)
    sampler.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, seed=1))
    assert len(seen) >= 3 and all(seen)  # the probe and each generated token's forward
    plain = build_sampler(full)
    assert plain.autocast_dtype is None
    assert {p.dtype for p in plain.model.parameters()} == {torch.float32}


def test_a_bf16_engine_worker_samples_and_checks_at_bf16() -> None:
    """End to end, a full fine-tune under bf16 autocast: the worker samples what the engine's
    own ``HFRollout`` samples (both under the engine's autocast), its log-probs are bf16's (not
    an fp32 forward's), and its pushes pass the 16-bit check."""
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2), tok
    )
    engine = ActorEngine(model, ActorConfig(dtype="bfloat16", micro_batch_size=16))
    with AsyncRollout(engine, tok) as worker:
        assert worker.sync_check_tol == LOW_PRECISION_SYNC_CHECK_TOL
        rollout = worker.generate(PROMPTS, SEEDED)
        assert_same(rollout, HFRollout(engine, tok).generate(PROMPTS, SEEDED))
        stats = worker.sync_stats[0]
        assert 0 < stats[SYNC_CHECK_STAT] < LOW_PRECISION_SYNC_CHECK_TOL / 10
    batch = rollout.batch
    with torch.no_grad():  # an fp32 forward of the same tokens
        am = batch["attention_mask"].long()
        logits = engine.model(
            input_ids=batch["input_ids"],
            attention_mask=am,
            position_ids=(am.cumsum(-1) - 1).clamp(min=0),
        ).logits.float()
    fp32 = logits[:, :-1].log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:]
    assert (fp32 - batch["rollout_logprobs"][:, 1:])[mask].abs().max() > 1e-3
