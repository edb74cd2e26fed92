"""The rollout source's schedule (microrl/run/source.py), against a stand-in worker and an
in-process sampler.

``RolloutSource`` submits the job of step ``t`` right after the weights of step ``t - 1 - k``
are pushed: each rollout is exactly ``k`` versions stale once the run is under way (fewer at its
start), never more (checked before training); the prompts are the recipe's stream in step
order, the same for every ``k``; nothing is dropped; a checkpoint holds the rounds not trained
yet and a restored source continues exactly as an uninterrupted one (at ``k = 0`` a round not
sampled yet is drawn again). Also the config's errors for settings asynchronous RL does not
support. The real worker process is tested in tests/rollout/samplers/test_hf_worker.py, the
recipe in tests/examples/.
"""

from __future__ import annotations

import io
import logging
import random

import pytest
import torch
from tensordict import TensorDict

from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import load_config
from microrl.configs.run import RolloutConfig
from microrl.losses import PolicyLossConfig
from microrl.rollout import InProcessSampler, Rollout, RolloutBackend, Samples, SamplingParams
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job
from microrl.run import Dist, RolloutSource, warn_if_uncorrected
from microrl.run.toy_model import build_tokenizer
from microrl.tasks import AdditionTask

PARAMS = SamplingParams(num_samples=2, max_new_tokens=3)


class FakeWorker:
    """What RolloutSource uses of AsyncRollout: jobs run in submission order, each at the
    version pushed last before it; a rollout's texts are its prompts' answers (reward 1)."""

    trainer_thread = samples_at_collect = False

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.sync_stats = {version: {"sync/probe_kl": 0.0, "sync/probe_abs_diff_max": 0.0}}
        self.log: list[tuple] = []  # ("sync", version) and ("submit", job id, version, prompts)
        self.jobs: dict[int, tuple[int, list[str]]] = {}

    def submit(self, prompts, params) -> Job:
        job = Job(len(self.log), self.version, "generate")
        self.jobs[job.id] = (self.version, list(prompts))
        self.log.append(("submit", job.id, self.version, list(prompts)))
        return job

    def sync(self, engine) -> None:
        self.version += 1
        self.sync_stats[self.version] = {
            "sync/probe_kl": 1e-9,
            "sync/probe_abs_diff_max": 1e-6 * self.version,
            "sync/probe_abs_diff_mean": 1e-7 * self.version,
        }
        self.log.append(("sync", self.version))

    def poll(self) -> None:
        pass

    def collect(self, job: Job) -> Rollout:
        version, prompts = self.jobs.pop(job.id)
        rows = len(prompts) * PARAMS.num_samples
        answers = [str(eval(p.rstrip("="))) for p in prompts for _ in range(PARAMS.num_samples)]
        batch = TensorDict(
            {
                "input_ids": torch.ones(rows, 4, dtype=torch.long),
                "loss_mask": torch.ones(rows, 4, dtype=torch.bool),
                POLICY_VERSION_KEY: torch.full((rows,), version, dtype=torch.long),
            },
            batch_size=[rows],
        )
        group_ids = torch.arange(len(prompts)).repeat_interleave(PARAMS.num_samples)
        return Rollout(batch=batch, texts=answers, group_ids=group_ids)

    def close(self) -> None:
        pass


def _run(
    k: int,
    steps: int,
    *,
    start: int = 0,
    state=None,
    stop_after: int | None = None,
    score_ahead: bool = False,
):
    """The recipe's loop over the source: take, (train), sync; returns the prompts trained
    per step, the staleness metrics, the worker and the source."""
    worker = FakeWorker(start)
    rng = random.Random(7)
    if state is not None:
        rng.setstate(state["rng"])
    source = RolloutSource(
        worker,
        AdditionTask(9, 8),
        PARAMS,
        rng,
        3,
        max_staleness=k,
        last_step=steps,
        state=state and state["ahead"],
        score_ahead=score_ahead,
    )
    trained, metrics = {}, {}
    for step in range(start + 1, steps + 1):
        problems, _, scores, metrics[step] = source.take(step)
        assert scores.tolist() == [1.0] * len(scores)  # scored against the right problems
        trained[step] = [p.prompt for p in problems]
        source.sync(engine=None)
        if step == stop_after:
            saved = {"ahead": source.state_dict(), "rng": rng.getstate()}
            source.close()
            return trained, metrics, saved
    source.close()
    return trained, metrics, worker


def _sync_prompts(steps: int) -> dict[int, list[str]]:
    """The synchronous recipe's prompt stream: step by step from the same seed."""
    rng, task = random.Random(7), AdditionTask(9, 8)
    return {s: [p.prompt for p in task.sample(rng, 3)] for s in range(1, steps + 1)}


@pytest.mark.parametrize(("k", "score_ahead"), [(1, False), (2, False), (3, False), (2, True)])
def test_each_step_trains_its_prompts_at_the_staleness_bound(k, score_ahead) -> None:
    """Also with the rounds collected and scored in the background thread (score_ahead)."""
    steps = 7
    trained, metrics, worker = _run(k, steps, score_ahead=score_ahead)
    assert trained == _sync_prompts(steps)  # the same prompts, in the same order as k = 0
    for step in range(1, steps + 1):
        # The job of step t is sampled with the weights after step max(0, t - 1 - k).
        assert metrics[step]["staleness/max"] == metrics[step]["staleness/mean"]
        assert metrics[step]["staleness/max"] == min(k, step - 1)
    # Every push but the tail's is followed by exactly one submitted job: paced, not dropped.
    kinds = [entry[0] for entry in worker.log]
    assert kinds[: k + 1] == ["submit"] * (k + 1)
    submits = [e for e in worker.log if e[0] == "submit"]
    assert [e[2] for e in submits] == [max(0, t - 1 - k) for t in range(1, steps + 1)]
    assert len(submits) == steps  # nothing sampled past the last step
    assert [e[1] for e in worker.log if e[0] == "sync"] == list(range(1, steps - k))
    # Each push's check is reported once, at the first step trained on its version.
    reported = [s for s in metrics if "sync/probe_kl" in metrics[s]]
    assert reported == [1, *range(k + 2, steps + 1)]
    # ... with the statistic the check bounds (the base's check of the fake carries none).
    for step in reported[1:]:
        version = step - 1 - k
        assert metrics[step]["sync/probe_abs_diff_max"] == pytest.approx(1e-6 * version)
        assert metrics[step]["sync/probe_abs_diff_mean"] == pytest.approx(1e-7 * version)
    assert "sync/probe_abs_diff_mean" not in metrics[1]


@pytest.mark.parametrize(("stop_after", "ahead"), [(1, False), (3, False), (5, False), (3, True)])
def test_a_restored_source_continues_exactly(stop_after, ahead) -> None:
    k, steps = 2, 7
    full, full_metrics, _ = _run(k, steps)
    first, _, state = _run(k, steps, stop_after=stop_after, score_ahead=ahead)
    # The checkpoint holds the rollouts sampled ahead, only plain types and tensors.
    ahead = state["ahead"]
    assert [item["step"] for item in ahead["items"]] == list(
        range(stop_after + 1, min(steps, stop_after + 1 + k) + 1)
    )
    buffer = io.BytesIO()
    torch.save(ahead, buffer)
    buffer.seek(0)
    state["ahead"] = torch.load(buffer, weights_only=True)  # as load_run reads it
    second, metrics, _ = _run(k, steps, start=stop_after, state=state, score_ahead=ahead)
    assert {**first, **second} == full  # every step's prompts trained exactly once, in order
    for step in second:
        assert metrics[step]["staleness/max"] == full_metrics[step]["staleness/max"]


def test_a_checkpoint_with_rollouts_ahead_needs_a_staleness_bound_that_holds_them() -> None:
    _, _, state = _run(2, 7, stop_after=3)
    for k in (1, 0):
        with pytest.raises(
            ValueError, match=rf"rollout.max_staleness={k} is below .*=2\): .* >= 2"
        ):
            _run(k, 7, start=3, state=state)


def test_a_rollout_beyond_the_bound_is_never_trained_on() -> None:
    worker = FakeWorker()
    source = RolloutSource(
        worker, AdditionTask(9, 8), PARAMS, random.Random(0), 2, max_staleness=1, last_step=5
    )
    source.take(1)
    worker.version = -1  # as if step 2's job had been sampled before the base weights
    source._rounds[0].job = worker.submit(["1+1="], PARAMS)
    with pytest.raises(RuntimeError, match=r"step 2: .* 2 versions stale, beyond "):
        source.take(2)


def test_k_without_a_behaviour_correction_warns_once_naming_the_corrections(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert warn_if_uncorrected(PolicyLossConfig(), 1)
        assert not warn_if_uncorrected(PolicyLossConfig(decoupled_is_cap=2.0), 1)
        assert not warn_if_uncorrected(PolicyLossConfig(), 0)
    (record,) = caplog.records
    for key in ("decoupled_is_cap", "tis_cap", "token_ratio_band", "seq_ratio_band"):
        assert key in record.getMessage()


@pytest.mark.parametrize(
    ("schema", "overrides", "message"),
    [
        (GRPOExampleConfig, ["rollout.max_staleness=-1"], "rollout.max_staleness must be an int"),
        (
            GRPOExampleConfig,
            ["rollout.server.url=http://localhost:8000", "rollout.max_staleness=1"],
            "rollout.server.url must be empty unless rollout.backend=vllm",
        ),
        (
            GRPOExampleConfig,
            ["rollout.backend=vllm", "rollout.server.url=http://localhost:8000"],
            "rollout.server.url must be empty with rollout.max_staleness=0",
        ),
        (
            GRPOExampleConfig,
            ["rollout.backend=vllm", "rollout.max_staleness=1", "rollout.server.url=localhost"],
            "rollout.server.url must be comma-separated http:// or https:// URLs",
        ),
        (GRPOExampleConfig, ["rollout.num_workers=0"], "rollout.num_workers must be an int >= 1"),
        (
            GRPOExampleConfig,
            ["rollout.max_staleness=2", "actor.policy_loss.bypass_mode=true"],
            "bypass_mode must be false with rollout.max_staleness > 0",
        ),
        (PPOExampleConfig, ["rollout.max_staleness=-1"], "rollout.max_staleness must be an int"),
        (
            PPOExampleConfig,
            ["rollout.max_staleness=1", "actor.policy_loss.bypass_mode=true"],
            "bypass_mode must be false with rollout.max_staleness > 0",
        ),
        (GRPOExampleConfig, ["rollout.sync_check_tol=0"], "rollout.sync_check_tol must be > 0"),
        (GRPOExampleConfig, ["rollout.worker_timeout_s=0"], "rollout.worker_timeout_s must be"),
    ],
)
def test_unsupported_settings_name_the_keys(schema, overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(schema, None, overrides)


def test_sequence_parallel_runs_async_on_vllm_servers() -> None:
    """An sp group samples on one vLLM server per group (docs/async.md), so the config loads."""
    overrides = ["rollout.max_staleness=1", "rollout.backend=vllm"]
    overrides += ["actor.sequence_parallel_size=2", "critic.sequence_parallel_size=2"]
    cfg = load_config(PPOExampleConfig, None, overrides)
    assert cfg.actor.sequence_parallel_size == 2 and cfg.rollout.max_staleness == 1


def test_defaults_are_the_synchronous_loop() -> None:
    assert RolloutConfig().max_staleness == 0
    assert load_config(GRPOExampleConfig).rollout.max_staleness == 0
    assert load_config(PPOExampleConfig).rollout.max_staleness == 0
    ppo = load_config(PPOExampleConfig, None, ["rollout.max_staleness=2"])  # both recipes take k
    assert ppo.rollout.max_staleness == 2
    # ... with dynamic sampling (GRPO) and, on hf workers, sequence parallelism
    both = ["rollout.max_staleness=1", "rollout.dynamic_sampling=true"]
    assert load_config(GRPOExampleConfig, None, both).rollout.dynamic_sampling
    sp = ["actor.sequence_parallel_size=2", "critic.sequence_parallel_size=2"]
    ppo = load_config(PPOExampleConfig, None, ["rollout.max_staleness=1", *sp])
    assert ppo.actor.sequence_parallel_size == 2


def test_agent_turns_sampled_ahead_end_at_the_models_terminators(tmp_path, monkeypatch) -> None:
    """Under ``rollout.max_staleness`` the agents' turns end where the workers stop sampling:
    at the model's ``generation_config.eos_token_id`` list too, not only the tokenizer's eos."""
    from transformers import GenerationConfig

    import microrl.run.session as session
    from microrl.agents.agent_sampler import AgentSampler
    from microrl.tasks import AgentTask

    tokenizer = build_tokenizer()
    extra = tokenizer.convert_tokens_to_ids("#")
    engine = torch.nn.Module()
    engine.model = torch.nn.Module()
    engine.model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, extra])
    inner, built = FakeWorker(), []
    monkeypatch.setattr(session, "make_sampler", lambda *args, **kwargs: inner)
    monkeypatch.setattr(session, "HFRollout", lambda *args, **kwargs: "the live model")
    monkeypatch.setattr(session, "RolloutSource", lambda sampler, *a, **k: built.append(sampler))

    async def agent(client, problem):
        return 0.0

    task = AgentTask(AdditionTask(max_operand=9, eval_size=10), agent)
    cfg = load_config(
        GRPOExampleConfig, None, ["rollout.max_staleness=1", f"output.dir={tmp_path}"]
    )
    _, policy = session.start_rollouts(
        cfg, engine, tokenizer, task, SamplingParams(), random.Random(0), 2,
        start_step=0, restored={}, dist_info=Dist(),
    )  # fmt: skip
    (sampler,) = built
    assert isinstance(sampler, AgentSampler) and sampler.inner is inner
    assert {tokenizer.eos_token_id, extra} <= set(sampler.stop_ids)
    assert policy == "the live model"  # evaluation samples the trainer's weights


class AnswerBackend(RolloutBackend):
    """Answers every prompt right, one token per row; counts its sampling calls."""

    def __init__(self) -> None:
        super().__init__(build_tokenizer())
        self.calls = 0

    def _sample(self, prompt_ids, params) -> Samples:
        self.calls += 1
        rows = len(prompt_ids) * params.num_samples
        return Samples(token_ids=[[5]] * rows, logprobs=[[-0.5]] * rows)


def _run_in_process(steps: int, *, start: int = 0, state=None, stop_after=None):
    """The recipe's loop at ``k = 0`` over a sampler of this process; the prompts trained per
    step and, when stopped, the checkpoint (the source's state and the stream's)."""
    sampler = InProcessSampler(AnswerBackend(), engine=None, version=start)
    rng = random.Random(7)
    if state is not None:
        rng.setstate(state["rng"])
    source = RolloutSource(
        sampler, AdditionTask(9, 8), PARAMS, rng, 3, last_step=steps, state=state and state["ahead"]
    )
    trained = {}
    for step in range(start + 1, steps + 1):
        calls = sampler.backend.calls
        problems, rollout, _, metrics = source.take(step)
        assert sampler.backend.calls == calls + 1  # sampled when the step took it
        assert rollout.batch[POLICY_VERSION_KEY].tolist() == [step - 1] * 6 and metrics == {}
        trained[step] = [p.prompt for p in problems]
        source.sync(engine=None)
        if step == stop_after:
            saved = {"ahead": source.state_dict(), "rng": rng.getstate()}
            source.close()
            return trained, saved
    source.close()
    return trained, None


def test_staleness_0_samples_each_step_when_it_takes_it_and_resumes_exactly() -> None:
    full, _ = _run_in_process(5)
    assert full == _sync_prompts(5)  # the prompt stream of every k
    first, state = _run_in_process(5, stop_after=2)
    (item,) = state["ahead"]["items"]  # step 3's round, drawn, not sampled: where it was drawn
    assert item["step"] == 3 and "drawn_from" in item and "rollout" not in item
    second, _ = _run_in_process(5, start=2, state=state)
    assert {**first, **second} == full
