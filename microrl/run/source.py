"""Every step's rollout, for any ``rollout.max_staleness = k >= 0``: one source, one path.

A :class:`RolloutSource` drives a :class:`~microrl.rollout.Sampler` with the recipe's prompt
stream, drawn in step order. Once version ``u`` is synced, the rounds of every step
``t <= u + 1 + k`` are submitted, so step ``t``'s rollout has a version in
``[t - 1 - k, t - 1]`` (checked before training). Checkpoints hold the rounds not trained yet,
so a resumed run trains on exactly the prompts and samples it would have (docs/async.md).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from microrl.configs.run import RolloutConfig
from microrl.engine.parallel import distributed
from microrl.engine.vision import from_plain_tensors, to_plain_tensors
from microrl.rollout import Rollout, SamplingParams
from microrl.rollout.images import png_base64, png_image, problem_images
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job, Sampler
from microrl.run.checkpoint import rng_state, set_rng_state
from microrl.run.dist import Dist
from microrl.run.dynamic_sampling import GroupFilter
from microrl.run.sampling import episode_limits, score_rollout, whole_groups
from microrl.tasks import Problem, Task, is_agent_task, is_episode_task

__all__ = ["ROLLOUT_BUFFER_KEY", "RolloutSource", "StepRollout"]

logger = logging.getLogger(__name__)

#: The key of the rounds not trained yet in a run checkpoint's loop state (``extra_state``).
ROLLOUT_BUFFER_KEY = "rollout_buffer"
_PROBE_METRICS = ("sync/probe_kl", "sync/probe_abs_diff_max", "sync/probe_abs_diff_mean")


class StepRollout(NamedTuple):
    """``problems[g]``: group ``g``'s prompt; ``scores`` ``[B]``: the task's rewards (no ``shaping``)."""

    problems: list[Problem]
    rollout: Rollout
    scores: torch.Tensor
    metrics: dict[str, float]


@dataclass
class _Round:
    """A round of prompts sampled (or being sampled) ahead: a step's, or one dynamic sampling filters."""

    problems: list[Problem]
    version: int
    job: Job | None = None
    rollout: Rollout | None = None
    scored: Future | None = None  # (rollout, scores), collected and scored in the background
    drawn_from: list | None = None  # the prompt stream's state before its problems


class RolloutSource:
    """The rollouts of steps ``start + 1 .. last_step``, at most ``max_staleness`` policy
    versions behind the trainer (see the module docstring).

    Args:
        sampler: what samples; its ``version`` is the trainer's step now (``start``).
        prompts_per_step: this rank's share of the prompts ``rng`` gives.
        max_staleness: ``k >= 0``, the rounds sampled ahead and the bound every row is held to.
        state: a :meth:`state_dict` from a checkpoint (its rounds come first).
        score_ahead: collect and score each round in a background thread (a slow reward);
            never for a ``trainer_thread`` sampler or a collective.
        scorer: ``scorer(rollout)`` adds keys (a teacher's log-probs) before the rewards.
        shaping: a per-row ``[B]`` term dynamic sampling adds to judge a group's spread.

    Metrics: ``dynamic_sampling/*``; with ``max_staleness > 0`` also ``staleness/*``,
    ``dynamic_sampling/rounds_waited`` and ``sync/probe_*``. :attr:`scorer_wait_s`: the part
    of the last take's wait ``scorer`` took.
    """

    def __init__(
        self,
        sampler: Sampler,
        task: Task,
        params: SamplingParams,
        rng: random.Random,
        prompts_per_step: int,
        *,
        max_staleness: int = 0,
        last_step: int,
        dist_info: Dist | None = None,
        limits: RolloutConfig | None = None,
        state: dict[str, Any] | None = None,
        pad_token_id: int | None = None,
        score_ahead: bool = False,
        scorer: Callable[[Rollout], None] | None = None,
        shaping: Callable[[Rollout], torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        self.sampler, self.task, self.params = sampler, task, params
        self.rng, self.prompts_per_step = rng, prompts_per_step
        self.max_staleness, self.last_step = max_staleness, last_step
        self.dist_info = dist_info or Dist()
        self.limits = limits or RolloutConfig()
        self.scorer, self.shaping, self.scorer_wait_s = scorer, shaping, 0.0
        self.episodes = is_episode_task(task) or is_agent_task(task)
        self.dynamic = self.limits.dynamic_sampling
        if self.dynamic and pad_token_id is None:
            raise ValueError("rollout.dynamic_sampling needs the tokenizer's pad_token_id")
        self.pad_token_id = pad_token_id
        self.start = sampler.version
        # Round i is trained at step _next_take + i at the latest.
        self._rounds: deque[_Round] = deque()
        self._next_take = self.start + 1
        self._reported = self.start - 1  # the newest version whose sync check was reported
        self._checks: dict[int, dict[str, float]] = {}  # checks a checkpoint carried over
        self._scorer = (
            ThreadPoolExecutor(1, thread_name_prefix="microrl-score") if score_ahead else None
        )
        self._polls: list[Future] = []
        self._waited = 0.0  # seconds the last take waited
        if state is not None:
            self._restore(state)
        self.fill()

    def fill(self) -> None:
        """Submit rounds for every step up to ``version + 1 + max_staleness`` (and ``last_step``)."""
        horizon = min(self.last_step, self.sampler.version + 1 + self.max_staleness)
        while self._next_take + len(self._rounds) <= horizon:
            self._rounds.append(self._submit())

    def _submit(self) -> _Round:
        """A round of ``prompts_per_step`` prompts from the stream, submitted now."""
        drawn_from = rng_state(self.rng)
        problems = self.task.sample(self.rng, self.prompts_per_step)
        if self.episodes:
            job = self.sampler.submit_episodes(problems, self.params, **episode_limits(self.limits))
        else:
            images = problem_images(problems)  # a problem's images go with its job
            kwargs = {} if images is None else {"images": images}  # text: any sampler's submit
            job = self.sampler.submit([p.prompt for p in problems], self.params, **kwargs)
        return self._score_ahead(_Round(problems, job.version, job=job, drawn_from=drawn_from))

    def _score_ahead(self, round_: _Round) -> _Round:
        if self._scorer is not None:
            round_.scored = self._scorer.submit(self._collect_and_score, round_)
        return round_

    def _collect_and_score(self, round_: _Round) -> tuple[Rollout, torch.Tensor, tuple]:
        """``round_``'s rollout, its rewards and when ``scorer`` ran on it (start, end)."""
        rollout = self._collect(round_)
        started = time.perf_counter()
        if self.scorer is not None:
            self.scorer(rollout)
        span = (started, time.perf_counter())
        return rollout, score_rollout(self.task, round_.problems, rollout), span

    def _scored(self, step: int, round_: _Round) -> tuple[Rollout, torch.Tensor]:
        """``round_``'s rollout, its staleness at ``step`` checked, and its rewards."""
        t0 = time.perf_counter()
        if round_.scored is not None:
            rollout, scores, span = round_.scored.result()
            self._raise_polled()
            self._check_staleness(step, rollout)
        else:  # staleness checked before anything is scored
            self._check_staleness(step, self._collect(round_))
            rollout, scores, span = self._collect_and_score(round_)
        t1 = time.perf_counter()
        self._waited += t1 - t0
        self.scorer_wait_s = max(0.0, min(t1, span[1]) - max(t0, span[0]))
        return rollout, scores

    def _poll(self) -> None:
        """The sampler's ``poll``: now, or queued behind the background thread's collects."""
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
        """After step ``u``'s updates: sync version ``u`` when a step still to be sampled (or
        evaluation) needs it, and submit the rounds now allowed. Collective."""
        needed = self._next_take if self.dynamic else self._next_take + len(self._rounds)
        if needed <= self.last_step or self.sampler.samples_at_collect:
            self.sampler.sync(engine)
            self.fill()
        self._poll()  # a failed check of an earlier push surfaces now

    def take(self, step: int) -> StepRollout:
        """Step ``step``'s problems, rollout, rewards and metrics. Collective under ``torchrun``."""
        have = list(range(self._next_take, self._next_take + len(self._rounds)))
        if step != self._next_take or not (have or self.dynamic):
            raise RuntimeError(f"step {step} has no rollout sampled ahead (holding steps {have})")
        self._waited = 0.0
        if self.dynamic:
            problems, rollout, scores, metrics = self._filtered(step)
        else:
            round_ = self._rounds.popleft()
            self._next_take += 1
            rollout, scores = self._scored(step, round_)
            problems, metrics = round_.problems, {}
        if self.limits.skip_env_errors:  # rows of failed episodes are gone: whole groups only
            rollout, scores, problems = whole_groups(
                rollout, scores, problems, self.limits.group_size
            )
        if self.max_staleness:
            metrics.update(self._staleness_metrics(step, rollout))
        return StepRollout(problems, rollout, scores, metrics)

    def _filtered(self, step: int) -> tuple[list[Problem], Rollout, torch.Tensor, dict]:
        """Step ``step``'s groups under dynamic sampling: the rounds ahead filtered in order,
        more submitted now if needed (``dynamic_sampling/rounds_waited``)."""
        groups = GroupFilter(
            self.prompts_per_step,
            self.dist_info,
            max_rounds=self.limits.max_sampling_rounds,
            shaping=self.shaping,
        )
        waited, more = 0, True
        while more:
            if not self._rounds:  # every round ahead is taken: one more, now
                self._rounds.append(self._submit())
                waited += 1
            round_ = self._rounds.popleft()
            rollout, scores = self._scored(step, round_)
            more = groups.add(round_.problems, rollout, scores)
        self._next_take += 1
        self.fill()  # now, so the freed rounds are sampled while this step trains
        problems, rollout, scores, metrics = groups.result(pad_token_id=self.pad_token_id)
        if self.max_staleness:
            metrics["dynamic_sampling/rounds_waited"] = float(waited)
        return problems, rollout, scores, metrics

    def _check_staleness(self, step: int, rollout: Rollout) -> None:
        staleness = (step - 1) - rollout.batch[POLICY_VERSION_KEY]
        worst = int(staleness.max()) if len(staleness) else 0
        if int(staleness.min()) < 0 or worst > self.max_staleness:  # never by construction
            raise RuntimeError(
                f"step {step}: a rollout sampled with policy version "
                f"{int(rollout.batch[POLICY_VERSION_KEY].min())} is {worst} versions stale, "
                f"beyond rollout.max_staleness={self.max_staleness}: refusing to train on it"
            )

    def _collect(self, round_: _Round) -> Rollout:
        if round_.rollout is None:
            round_.rollout = self.sampler.collect(round_.job)
            round_.job = None
        return round_.rollout

    def close(self) -> None:
        """Stop the sampler (and the scoring thread, whose collect then fails at once)."""
        try:
            self.sampler.close()
        finally:
            if self._scorer is not None:
                self._scorer.shutdown(wait=True, cancel_futures=True)

    def _staleness_metrics(self, step: int, rollout: Rollout) -> dict[str, float]:
        """``staleness/*`` and the ``sync/probe_*`` (the largest) of the pushes now completed."""
        staleness = ((step - 1) - rollout.batch[POLICY_VERSION_KEY]).double()
        rows, total = self.dist_info.sum([float(len(staleness)), float(staleness.sum())])
        worst = distributed.max_over_ranks(int(staleness.max()) if len(staleness) else 0)
        metrics = {"staleness/mean": total / max(rows, 1.0), "staleness/max": float(worst)}
        # The slowest rank's wait: the step waits for it.
        waited_us = distributed.max_over_ranks(round(self._waited * 1e6))
        metrics["staleness/take_wait_s"] = waited_us / 1e6
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

    def state_dict(self) -> dict[str, Any]:
        """The rounds not trained yet, as ``torch.load(weights_only=True)`` reads them."""
        items = []
        for i, round_ in enumerate(self._rounds):
            item = {"step": self._next_take + i, "version": round_.version}
            if round_.rollout is None and self.sampler.samples_at_collect:
                item["drawn_from"] = round_.drawn_from  # sampled when resumed, as it would be
            else:
                if round_.scored is not None:  # its collect in the background thread, done
                    wait([round_.scored])  # (a failed scoring is the next take's error)
                item["problems"] = [_problem_to_json(p) for p in round_.problems]
                item["rollout"] = _rollout_to_plain(self._collect(round_))
            items.append(item)
        # Pushes checked but not reported yet: the steps after the checkpoint report them.
        stats = {**self._checks, **self.sampler.sync_stats}
        checks = {str(v): dict(stats[v]) for v in sorted(stats) if v > self._reported}
        return {
            "max_staleness": self.max_staleness,
            "next_step": self._next_take + len(self._rounds),
            "items": items,
            "sync_checks": checks,
            "reported": self._reported,
        }

    def extra_state(self) -> dict[str, Any]:
        """:meth:`state_dict` as the ``extra_state`` of :func:`~microrl.run.save_run`."""
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
                    f"rollout of step {item['step']} the checkpoint holds ({staleness} versions, "
                    f"sampled ahead by a run with rollout.max_staleness={state['max_staleness']})"
                    f": resume with rollout.max_staleness >= {staleness}"
                )
            if "drawn_from" in item:  # not sampled yet: drawn (the same prompts) and submitted
                set_rng_state(self.rng, item["drawn_from"])
                self._rounds.append(self._submit())
                continue
            problems = [_problem_from_json(p) for p in item["problems"]]
            rollout = _rollout_from_plain(item["rollout"])
            self._rounds.append(
                self._score_ahead(_Round(problems, item["version"], rollout=rollout))
            )
        self._checks = {int(v): dict(s) for v, s in state.get("sync_checks", {}).items()}
        self._reported = int(state.get("reported", self.start - 1))


def _rollout_to_plain(rollout: Rollout) -> dict[str, Any]:
    return {**vars(rollout), "batch": to_plain_tensors(rollout.batch)}  # weights_only loads it


def _rollout_from_plain(saved: dict[str, Any]) -> Rollout:
    batch = from_plain_tensors(saved["batch"], len(saved["texts"]))
    return Rollout(**{**saved, "batch": batch})


def _problem_to_json(problem: Problem) -> str:
    """A problem as JSON text; its images as base64 PNGs (lossless: a resumed run sees the same pixels)."""
    row: dict[str, Any] = {
        "prompt": problem.prompt,
        "answer": problem.answer,
        "columns": dict(problem.columns),
    }
    if problem.images:
        row["images_png"] = [png_base64(image) for image in problem.images]
    try:
        return json.dumps(row)
    except TypeError as err:
        raise ValueError(
            "a checkpoint of a run with rollout.max_staleness > 0 holds the problems of the "
            f"rollouts sampled ahead as JSON, and this task's rows are not ({err})"
        ) from err


def _problem_from_json(text: str) -> Problem:
    row = json.loads(text)
    images = tuple(png_image(data) for data in row.pop("images_png", ()))
    return Problem(**row, images=images)
