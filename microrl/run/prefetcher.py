"""Asynchronous RL in a recipe: the next steps' rollouts, sampled ahead under a staleness bound.

A :class:`RolloutPrefetcher` drives an :class:`~microrl.rollout.Sampler` with
the recipe's own prompt stream (``task.sample(rng, n)`` in the trainer process, step after
step, so ``rollout.max_staleness=k`` trains on the same prompts in the same order as ``k=0``).
Its schedule is fixed: once the weights after step ``u`` are pushed (version ``u``), the jobs of
every step ``t <= u + 1 + k`` are submitted. The worker runs jobs and pushes in that order, so
the rollout trained at step ``t`` is sampled with version ``max(start, t - 1 - k)`` exactly: its
staleness ``(t - 1) - version`` (the trainer is at version ``t - 1`` when step ``t`` trains)
lies in ``[0, k]``, and is checked before anything trains on it. The worker waits for new
weights rather than run further ahead; no sample is ever dropped. With dynamic sampling the
jobs are rounds that the steps filter in order (:meth:`RolloutPrefetcher.take_groups`,
docs/async.md#dynamic-sampling), and under sequence parallelism an sp group shares one sampler.

Checkpoints (:meth:`RolloutPrefetcher.state_dict`, saved with the run) hold the rollouts sampled
but not yet trained on (their problems, batches and versions; jobs still running are waited for
first) and the next step to sample; the Python RNG the run saves is the prompt stream's position
after them. A resumed run trains on exactly the prompts, and samples, it would have.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from microrl.configs.run import RolloutConfig
from microrl.engine.parallel import distributed
from microrl.engine.vision import from_plain_tensors, to_plain_tensors
from microrl.rollout import Rollout, SamplingParams
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, Sampler
from microrl.run.dist import Dist
from microrl.run.dynamic_sampling import DynamicSample, GroupFilter
from microrl.run.sampling import score_rollout
from microrl.run.vision import problem_images
from microrl.tasks import Problem, Task, is_agent_task, is_episode_task

__all__ = ["CORRECTIONS", "ROLLOUT_BUFFER_KEY", "RolloutPrefetcher"]

logger = logging.getLogger(__name__)

#: The key of the rollouts sampled ahead in a run checkpoint's loop state (``extra_state``).
ROLLOUT_BUFFER_KEY = "rollout_buffer"
#: The policy-loss keys that correct for the behaviour policy (docs/async.md).
CORRECTIONS = ("tis_cap", "token_ratio_band", "seq_ratio_band", "decoupled_is_cap")
# The probe statistics of a push's check, reported once per push (docs/rollouts.md).
_PROBE_METRICS = ("sync/probe_kl", "sync/probe_abs_diff_max", "sync/probe_abs_diff_mean")


@dataclass
class _Ahead:
    """A round of prompts sampled (or being sampled) ahead: a step's rollout, or with dynamic
    sampling one of the rounds the steps filter in order."""

    problems: list[Problem]
    version: int
    job: Job | None = None
    rollout: Rollout | None = None
    scored: Future | None = None  # (rollout, scores), collected and scored in the background


class RolloutPrefetcher:
    """Samples the rollouts of steps ``start + 1 .. last_step`` ahead of the trainer, at most
    ``max_staleness`` policy versions behind it (see the module docstring).

    Args:
        sampler: the worker; its ``version`` is the trainer's step now (``start``).
        task: the task (its ``sample`` draws the prompts; its ``score``, or the episodes'
            rewards, scores the rows).
        params: sampling parameters of every job.
        rng: the recipe's prompt stream (``random.Random``), drawn here in step order.
        prompts_per_step: prompts per step (this rank's share).
        max_staleness: ``k >= 1``.
        last_step: the run's last step: nothing is sampled past it.
        limits: the rollout config: a multi-turn task's episode limits, and
            ``dynamic_sampling`` (steps filter rounds with :meth:`take_groups`, whose
            ``max_sampling_rounds`` caps the rounds of a step).
        state: a :meth:`state_dict` from a checkpoint (the rollouts it holds are trained first).
        pad_token_id: the tokenizer's, which pads merged rounds (dynamic sampling).
        score_ahead: collect and score each round in a background thread as soon as the
            sampler has it, so the trainer does not wait for a slow reward (a reward model, an
            LLM judge; docs/async.md#scoring-ahead). The thread is then the only caller of the
            sampler's ``collect`` and ``poll``. Not for a sampler whose ``collect`` is a
            collective (a sequence-parallel group's), nor a ``scorer`` that is one.
        scorer: ``scorer(rollout)`` adds keys to each round's batch before its rewards are
            scored (a teacher's log-probs; docs/recipes.md#teachers), on the thread with
            ``score_ahead``; it keeps a batch that holds its keys (a checkpoint's round).

    Metric: ``staleness/take_wait_s``, the seconds the trainer waited in :meth:`take` or
    :meth:`take_groups` for the step's rollout and its rewards; :attr:`scorer_wait_s`, the
    part of the last take's wait that ``scorer`` took (not the sampling before it).
    """

    def __init__(
        self,
        sampler: Sampler,
        task: Task,
        params: SamplingParams,
        rng: random.Random,
        prompts_per_step: int,
        *,
        max_staleness: int,
        last_step: int,
        limits: RolloutConfig | None = None,
        state: dict[str, Any] | None = None,
        pad_token_id: int | None = None,
        score_ahead: bool = False,
        scorer: Callable[[Rollout], None] | None = None,
    ) -> None:
        if not isinstance(max_staleness, int) or max_staleness < 1:
            raise ValueError(f"max_staleness must be an int >= 1, got {max_staleness!r}")
        self.sampler = sampler
        self.scorer = scorer
        self.scorer_wait_s = 0.0
        self.task = task
        self.params = params
        self.rng = rng
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.last_step = last_step
        self.limits = limits or RolloutConfig()
        self.episodes = is_episode_task(task) or is_agent_task(task)
        self.dynamic = self.limits.dynamic_sampling
        if self.dynamic and pad_token_id is None:
            raise ValueError("rollout.dynamic_sampling needs the tokenizer's pad_token_id")
        self.pad_token_id = pad_token_id
        self.start = sampler.version
        # The rounds sampled ahead, in prompt-stream order, and the next step to train: round
        # i is trained at step _next_take + i at the latest (each step takes one or more).
        self._ahead: deque[_Ahead] = deque()
        self._next_take = self.start + 1
        self._reported = self.start - 1  # the newest version whose sync check was reported
        self._checks: dict[int, dict[str, float]] = {}  # checks a checkpoint carried over
        # One thread: rounds are collected and scored in submission order, polls between them.
        self._scorer = (
            ThreadPoolExecutor(1, thread_name_prefix="microrl-score") if score_ahead else None
        )
        self._polls: list[Future] = []
        self._waited = 0.0  # seconds take() waited since the last metrics()
        if state is not None:
            self._restore(state)
        self.fill()

    # ----------------------------------------------------------------- the schedule
    def fill(self) -> None:
        """Submit rounds until one is sampled ahead for every step up to
        ``version + 1 + max_staleness`` (and ``last_step``), drawing their prompts now, in
        order. Without dynamic sampling round ``i`` is step ``next + i``'s rollout; with it the
        rounds a step takes are refilled here (after the step took them, and after the push),
        so every round is trained on within ``max_staleness`` versions (a step takes at least
        one)."""
        horizon = min(self.last_step, self.sampler.version + 1 + self.max_staleness)
        while self._next_take + len(self._ahead) <= horizon:
            self._ahead.append(self._submit())

    def _submit(self) -> _Ahead:
        """A round of ``prompts_per_step`` prompts from the stream, submitted now."""
        problems = self.task.sample(self.rng, self.prompts_per_step)
        if self.episodes:
            job = self.sampler.submit_episodes(
                problems,
                self.params,
                max_turns=self.limits.max_turns,
                max_tokens=self.limits.max_episode_tokens,
                skip_env_errors=self.limits.skip_env_errors,
            )
        else:
            prompts = [p.prompt for p in problems]
            images = problem_images(problems)  # a problem's images go with its job
            job = (
                self.sampler.submit(prompts, self.params)
                if images is None
                else self.sampler.submit(prompts, self.params, images=images)
            )
        return self._score_ahead(_Ahead(problems, job.version, job=job))

    def _score_ahead(self, ahead: _Ahead) -> _Ahead:
        if self._scorer is not None:
            ahead.scored = self._scorer.submit(self._collect_and_score, ahead)
        return ahead

    def _collect_and_score(self, ahead: _Ahead) -> tuple[Rollout, torch.Tensor, tuple]:
        """``ahead``'s rollout, its rewards and when ``scorer`` ran on it (start, end)."""
        rollout = self._collect(ahead)
        started = time.perf_counter()
        if self.scorer is not None:
            self.scorer(rollout)
        span = (started, time.perf_counter())
        return rollout, score_rollout(self.task, ahead.problems, rollout), span

    def _scored(self, step: int, ahead: _Ahead) -> tuple[Rollout, torch.Tensor]:
        """``ahead``'s rollout, its staleness at ``step`` checked, and its rewards (scored in
        the background with ``score_ahead``; the wait counts in ``staleness/take_wait_s``)."""
        t0 = time.perf_counter()
        if ahead.scored is not None:
            rollout, scores, span = ahead.scored.result()
            self._raise_polled()
            self._check_staleness(step, rollout)
        else:  # staleness checked before anything is scored
            self._check_staleness(step, self._collect(ahead))
            rollout, scores, span = self._collect_and_score(ahead)
        t1 = time.perf_counter()
        self._waited += t1 - t0
        self.scorer_wait_s = max(0.0, min(t1, span[1]) - max(t0, span[0]))
        return rollout, scores

    def _poll(self) -> None:
        """The sampler's ``poll``: now, or queued behind the background thread's collects
        (never beside one); a failure surfaces at the next take."""
        if self._scorer is None:
            self.sampler.poll()
            return
        self._raise_polled()
        self._polls.append(self._scorer.submit(self.sampler.poll))

    def _raise_polled(self) -> None:
        done = [f for f in self._polls if f.done()]
        self._polls = [f for f in self._polls if not f.done()]
        for future in done:
            future.result()  # raises what the poll raised

    def sync(self, engine) -> None:
        """After step ``u``'s updates: push the weights (version ``u``) when a step still to be
        sampled needs them (with dynamic sampling: any step still to train, whose extra rounds
        sample the newest weights), and submit the rounds that become allowed. Collective under
        ``torchrun``."""
        needed = self._next_take if self.dynamic else self._next_take + len(self._ahead)
        if needed <= self.last_step:
            self.sampler.sync(engine)
            self.fill()
        self._poll()  # a failed check of an earlier push surfaces now

    def take(self, step: int) -> tuple[list[Problem], Rollout, torch.Tensor]:
        """Step ``step``'s problems, rollout (with ``policy_version`` per row) and rewards."""
        self._check_step(step)
        if not self._ahead:
            raise RuntimeError(f"step {step} has no rollout sampled ahead (holding steps [])")
        ahead = self._ahead.popleft()
        self._next_take += 1
        rollout, scores = self._scored(step, ahead)
        return ahead.problems, rollout, scores

    def take_groups(
        self,
        step: int,
        dist_info: Dist,
        *,
        shaping: Callable[[Rollout], torch.Tensor] | None = None,
    ) -> DynamicSample:
        """Step ``step``'s groups under dynamic sampling: the rounds sampled ahead, in order,
        filtered by :class:`~microrl.run.dynamic_sampling.GroupFilter` (``shaping``: as
        :func:`~microrl.run.dynamic_sampling.dynamic_sample`'s) until enough groups have a
        reward spread or ``rollout.max_sampling_rounds`` rounds ran; a round the step needs
        beyond those sampled ahead is sampled now, with the newest weights. Then the rounds it
        took are replaced (:meth:`fill`), before it trains: the worker samples them meanwhile,
        up to ``max_staleness`` rounds. Metrics: the
        synchronous run's ``dynamic_sampling/*`` and ``dynamic_sampling/rounds_waited``, the
        rounds sampled now (the trainer waited for them). Collective under ``torchrun``."""
        self._check_step(step)
        groups = GroupFilter(
            self.prompts_per_step,
            dist_info,
            max_rounds=self.limits.max_sampling_rounds,
            shaping=shaping,
        )
        waited, more = 0, True
        while more:
            if not self._ahead:  # every round sampled ahead is taken: one more, now
                self._ahead.append(self._submit())
                waited += 1
            ahead = self._ahead.popleft()
            rollout, scores = self._scored(step, ahead)
            more = groups.add(ahead.problems, rollout, scores)
        self._next_take += 1
        # The rounds this step freed, submitted now with the weights it trains from, so they
        # are sampled while it trains (at sync() only, a step that took every round ahead left
        # the worker idle through its update, and the next step's rounds were all fresh).
        self.fill()
        result = groups.result(pad_token_id=self.pad_token_id)
        result.metrics["dynamic_sampling/rounds_waited"] = float(waited)
        return result

    def _check_step(self, step: int) -> None:
        if step != self._next_take:
            have = list(range(self._next_take, self._next_take + len(self._ahead)))
            raise RuntimeError(f"step {step} has no rollout sampled ahead (holding steps {have})")

    def _check_staleness(self, step: int, rollout: Rollout) -> None:
        """Raise when ``rollout``'s staleness at ``step`` is beyond ``max_staleness`` (a
        rollout past it is never trained on)."""
        staleness = (step - 1) - rollout.batch[POLICY_VERSION_KEY]
        worst = int(staleness.max()) if len(staleness) else 0
        if int(staleness.min()) < 0 or worst > self.max_staleness:  # never by construction
            raise RuntimeError(
                f"step {step}: a rollout sampled with policy version "
                f"{int(rollout.batch[POLICY_VERSION_KEY].min())} is {worst} versions stale, "
                f"beyond rollout.max_staleness={self.max_staleness}: refusing to train on it"
            )

    def _collect(self, ahead: _Ahead) -> Rollout:
        if ahead.rollout is None:
            ahead.rollout = self.sampler.collect(ahead.job)
            ahead.job = None
        return ahead.rollout

    def close(self) -> None:
        """Stop the worker (and the scoring thread, whose collect then fails at once)."""
        try:
            self.sampler.close()
        finally:
            if self._scorer is not None:
                self._scorer.shutdown(wait=True, cancel_futures=True)

    # ----------------------------------------------------------------- metrics
    def metrics(self, step: int, rollout: Rollout, dist_info: Dist) -> dict[str, float]:
        """``staleness/mean`` and ``staleness/max`` (trainer version ``step - 1`` minus each
        trained row's version, over every rank) and the checks of the pushes this rollout's
        version completed: ``sync/probe_kl``, ``sync/probe_abs_diff_max`` and
        ``sync/probe_abs_diff_mean`` (the statistic ``rollout.sync_check_tol`` bounds; the largest
        of each when several complete at once; none before a step's version has a new push)."""
        staleness = ((step - 1) - rollout.batch[POLICY_VERSION_KEY]).double()
        rows, total = dist_info.sum([float(len(staleness)), float(staleness.sum())])
        worst = distributed.max_over_ranks(int(staleness.max()) if len(staleness) else 0)
        metrics = {"staleness/mean": total / max(rows, 1.0), "staleness/max": float(worst)}
        # The slowest rank's wait: the step waits for it.
        waited_us = distributed.max_over_ranks(round(self._waited * 1e6))
        metrics["staleness/take_wait_s"] = waited_us / 1e6
        self._waited = 0.0
        version = int(rollout.batch[POLICY_VERSION_KEY].max()) if len(staleness) else -1
        stats = {**self._checks, **self.sampler.sync_stats}
        checked = [v for v in sorted(stats) if self._reported < v <= version]
        if checked:
            self._reported = checked[-1]
            for name in _PROBE_METRICS:  # (a check restored from an older run may lack one)
                values = [stats[v][name] for v in checked if name in stats[v]]
                if values:
                    metrics[name] = max(values)
        return metrics

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The rollouts sampled ahead (waiting for running jobs first), for the run checkpoint:
        tensors, strings and numbers only (``torch.load(weights_only=True)``)."""
        items = []
        for i, ahead in enumerate(self._ahead):
            if ahead.scored is not None:  # its collect in the background thread, done
                wait([ahead.scored])  # (a failed scoring is the next take's error, not this)
            rollout = self._collect(ahead)
            items.append(
                {
                    "step": self._next_take + i,  # the step that trains it, at the latest
                    "version": ahead.version,
                    "problems": [_problem_to_json(p) for p in ahead.problems],
                    "rollout": {
                        "batch": to_plain_tensors(rollout.batch),  # weights_only loads it
                        "texts": list(rollout.texts),
                        "group_ids": rollout.group_ids,
                        "rewards": rollout.rewards,
                        "num_turns": rollout.num_turns,
                        "metrics": dict(rollout.metrics),
                    },
                }
            )
        # Pushes checked but not reported yet: the steps after the checkpoint report them.
        stats = {**self._checks, **self.sampler.sync_stats}
        checks = {str(v): dict(stats[v]) for v in sorted(stats) if v > self._reported}
        return {
            "max_staleness": self.max_staleness,
            "next_step": self._next_take + len(self._ahead),
            "items": items,
            "sync_checks": checks,
            "reported": self._reported,
        }

    def extra_state(self) -> dict[str, Any]:
        """:meth:`state_dict` as the ``extra_state`` of :func:`~microrl.run.save_run`
        (:func:`resumed_rollouts` reads it back)."""
        return {ROLLOUT_BUFFER_KEY: self.state_dict()}

    def _restore(self, state: dict[str, Any]) -> None:
        items = state["items"]
        expected = list(range(self.start + 1, self.start + 1 + len(items)))
        if [item["step"] for item in items] != expected:
            raise ValueError(
                f"the checkpoint's rollouts sampled ahead are for steps "
                f"{[item['step'] for item in items]}, not the steps after {self.start}"
            )
        for item in items:
            staleness = (item["step"] - 1) - item["version"]
            if staleness > self.max_staleness:
                raise ValueError(
                    f"rollout.max_staleness={self.max_staleness} is below the staleness of the "
                    f"rollout of step {item['step']} the checkpoint holds ({staleness} versions): "
                    f"resume with rollout.max_staleness >= {staleness}"
                )
            saved = item["rollout"]
            rows = len(saved["texts"])
            rollout = Rollout(
                batch=from_plain_tensors(saved["batch"], rows),
                texts=list(saved["texts"]),
                group_ids=saved["group_ids"],
                rewards=saved["rewards"],
                num_turns=saved["num_turns"],
                metrics=dict(saved["metrics"]),
            )
            problems = [_problem_from_json(p) for p in item["problems"]]
            self._ahead.append(
                self._score_ahead(_Ahead(problems, item["version"], rollout=rollout))
            )
        self._checks = {int(v): dict(s) for v, s in state.get("sync_checks", {}).items()}
        self._reported = int(state.get("reported", self.start - 1))


def _problem_to_json(problem: Problem) -> str:
    """A problem as JSON text; its images (if any) as base64 PNGs: lossless, so a resumed run
    samples and scores the very pixels (and image modes) it drew."""
    row: dict[str, Any] = {
        "prompt": problem.prompt,
        "answer": problem.answer,
        "columns": dict(problem.columns),
    }
    if problem.images:
        row["images_png"] = [_png_base64(image) for image in problem.images]
    try:
        return json.dumps(row)
    except TypeError as err:
        raise ValueError(
            "a checkpoint of a run with rollout.max_staleness > 0 holds the problems of the "
            f"rollouts sampled ahead as JSON, and this task's rows are not ({err})"
        ) from err


def _problem_from_json(text: str) -> Problem:
    row = json.loads(text)
    images = tuple(_png_image(data) for data in row.pop("images_png", ()))
    return Problem(**row, images=images)


def _png_base64(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _png_image(data: str) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()  # read now: the buffer goes
    return image
