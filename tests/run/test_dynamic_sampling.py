"""DAPO's dynamic sampling (microrl/run/dynamic_sampling.py, in the rollout source of
microrl/run/source.py) with a scripted task and sampler.

The task says which prompts' groups get a reward spread; the sampler answers every prompt the
same way each time, so a step's kept groups can be sampled again directly and compared. The
2-rank test launches this file on gloo ranks (``distributed_utils.launch``): every rank runs the
same number of rounds, whichever needs them. With ``rollout.max_staleness=k`` the source
filters rounds sampled ahead: the same rounds keep the same groups as at ``k = 0`` (rounds
sampled when the step takes them), no round is older than k, and every round drawn is counted.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the ranks

from microrl.configs.run import RolloutConfig
from microrl.losses import grpo_advantages
from microrl.rollout import InProcessSampler, RolloutBackend, Samples, SamplingParams
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job
from microrl.run import Dist, GroupFilter, RolloutSource
from microrl.run.toy_model import build_tokenizer
from microrl.tasks import Problem

HERE = Path(__file__).resolve()
PARAMS = SamplingParams(num_samples=3, max_new_tokens=4)


class ScriptedTask:
    """Prompt ``i`` (``"<i>+0="``, in sampling order) has a reward spread iff ``spread[i]``: its
    rows score 1.0 when their response has an even length, else 0; otherwise all rows score 0."""

    solved_threshold = 1.0

    def __init__(self, spread: list[bool]) -> None:
        self.spread, self.drawn = spread, 0

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        first, self.drawn = self.drawn, self.drawn + n
        return [
            Problem(f"{i}+0=", "spread" if self.spread[i] else "equal")
            for i in range(first, first + n)
        ]

    def eval_problems(self) -> list[Problem]:
        return []

    def score(self, responses, problems) -> list[float]:
        return [
            float(p.answer == "spread" and len(text) % 2 == 0)
            for text, p in zip(responses, problems, strict=True)
        ]


class ScriptedSampler(RolloutBackend):
    """Sample ``j`` of a prompt is ``"1" * (1 + (j + len(prompt)) % 3)`` then ``<eos>``: the
    same for the same prompt, different lengths within a group and between rounds."""

    def __init__(self) -> None:
        super().__init__(build_tokenizer())
        self.calls = 0
        self.one = self.tokenizer.convert_tokens_to_ids("1")

    def _sample(self, prompt_ids, params) -> Samples:
        self.calls += 1
        ids, logprobs = [], []
        for prompt in prompt_ids:
            for j in range(params.num_samples):
                row = [self.one] * (1 + (j + len(prompt)) % 3) + [self.tokenizer.eos_token_id]
                ids.append(row)
                logprobs.append([-0.1 * (c + 1) for c in range(len(row))])
        return Samples(token_ids=ids, logprobs=logprobs)


def _synchronous(task, sampler, n, max_rounds, dist_info=None, shaping=None):
    """One step at ``k = 0``: its rounds sampled in this process when the step takes them."""
    source = RolloutSource(
        InProcessSampler(sampler, engine=None),
        task,
        PARAMS,
        random.Random(0),
        n,
        last_step=1,
        dist_info=dist_info or Dist(),
        limits=RolloutConfig(dynamic_sampling=True, max_sampling_rounds=max_rounds),
        pad_token_id=sampler.tokenizer.pad_token_id,
        shaping=shaping,
    )
    return source.take(1)


def _run(spread, n, max_rounds, dist_info=None, **kwargs):
    task, sampler = ScriptedTask(spread), ScriptedSampler()
    return _synchronous(task, sampler, n, max_rounds, dist_info, **kwargs), sampler


def _check_is_sampled_directly(result, n: int, shaping=None) -> torch.Tensor:
    """The kept groups, sampled again in one call: the same batch, texts and scores; group ids
    contiguous. Returns the rewards the advantages would use."""
    direct_sampler = ScriptedSampler()
    direct = direct_sampler.generate([p.prompt for p in result.problems], PARAMS)
    assert set(result.rollout.batch.keys()) == {*direct.batch.keys(), POLICY_VERSION_KEY}
    for key in direct.batch.keys():  # noqa: SIM118 (a TensorDict iterates over its rows)
        assert torch.equal(result.rollout.batch[key], direct.batch[key]), key
    assert result.rollout.texts == direct.texts
    assert result.rollout.group_ids.tolist() == direct.group_ids.tolist()
    assert len(result.problems) == n and result.rollout.batch.batch_size[0] == n * 3
    answered = [result.problems[g] for g in direct.group_ids.tolist()]
    expected = torch.tensor(ScriptedTask([]).score(direct.texts, answered))
    assert torch.equal(result.scores, expected)
    return result.scores if shaping is None else result.scores + shaping(result.rollout)


def _prompt_numbers(result) -> list[int]:
    return [int(p.prompt.split("+")[0]) for p in result.problems]


def test_rounds_until_enough_groups_have_a_reward_spread() -> None:
    spread = [True, False, False, False, True, True, True, True, True]
    result, sampler = _run(spread, n=3, max_rounds=4)
    assert sampler.calls == 2 and _prompt_numbers(result) == [0, 4, 5]
    rewards = _check_is_sampled_directly(result, 3)
    _, info = grpo_advantages(rewards, result.rollout.group_ids)
    assert info.num_zero_variance_groups == 0
    assert result.metrics == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/groups_dropped": 3.0,
        "dynamic_sampling/groups_filled": 0.0,
        "dynamic_sampling/groups_surplus": 0.0,
    }


def test_spread_groups_beyond_the_need_are_surplus_kept_in_sampling_order() -> None:
    result, sampler = _run([False, True, True, True], n=2, max_rounds=4)
    assert sampler.calls == 2 and _prompt_numbers(result) == [1, 2]
    _check_is_sampled_directly(result, 2)
    assert result.metrics["dynamic_sampling/groups_surplus"] == 1.0
    assert result.metrics["dynamic_sampling/groups_dropped"] == 1.0


def test_at_the_cap_the_last_rounds_equal_groups_top_up() -> None:
    spread = [False, False, False, False, True, False]
    result, sampler = _run(spread, n=3, max_rounds=2)
    assert sampler.calls == 2 and _prompt_numbers(result) == [3, 4, 5]  # the whole last round
    rewards = _check_is_sampled_directly(result, 3)
    _, info = grpo_advantages(rewards, result.rollout.group_ids)
    assert info.num_zero_variance_groups == 2  # the top-up: advantage 0
    assert result.metrics == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/groups_dropped": 3.0,
        "dynamic_sampling/groups_filled": 2.0,
        "dynamic_sampling/groups_surplus": 0.0,
    }
    # One round is a step without dynamic sampling: the first prompts, equal groups and all.
    result, sampler = _run([False, True], n=2, max_rounds=1)
    assert sampler.calls == 1 and _prompt_numbers(result) == [0, 1]
    assert result.metrics["dynamic_sampling/groups_filled"] == 1.0


def test_the_spread_is_that_of_the_shaped_reward() -> None:
    """A length term (like the overlong penalty) makes equal task scores differ."""

    def shaping(rollout):
        return -0.1 * rollout.batch["loss_mask"].sum(1)

    result, sampler = _run([False] * 3, n=3, max_rounds=4, shaping=shaping)
    assert sampler.calls == 1 and _prompt_numbers(result) == [0, 1, 2]
    assert not result.scores.any()  # the task's scores, without the shaping term
    rewards = _check_is_sampled_directly(result, 3, shaping)
    assert grpo_advantages(rewards, result.rollout.group_ids)[1].num_zero_variance_groups == 0


def test_a_step_needs_at_least_one_round() -> None:
    with pytest.raises(ValueError, match=r"rollout\.max_sampling_rounds"):
        GroupFilter(1, Dist(), max_rounds=0)


# ============================================================================ sampled ahead


class ScriptedWorker:
    """The asynchronous job interface over :class:`ScriptedSampler`: a job samples at the version
    pushed last before it (``policy_version``)."""

    trainer_thread = samples_at_collect = False

    def __init__(self, version: int = 0) -> None:
        self.sampler, self.version, self.sync_stats = ScriptedSampler(), version, {}
        self.jobs: dict[int, tuple[int, list[str]]] = {}  # submitted, not collected yet
        self.submitted = 0

    def submit(self, prompts, params) -> Job:
        job = Job(self.submitted, self.version, "generate")
        self.submitted += 1
        self.jobs[job.id] = (self.version, list(prompts))
        return job

    def collect(self, job: Job):
        version, prompts = self.jobs.pop(job.id)
        rollout = self.sampler.generate(prompts, PARAMS)
        rollout.batch[POLICY_VERSION_KEY] = torch.full((len(rollout.texts),), version)
        return rollout

    def sync(self, engine) -> None:
        self.version += 1

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass


# Which prompts have a reward spread, for rounds of two prompts and at most 3 rounds a step.
STEPS_SPREAD = [
    *[True, True],  # step 1 keeps its first round
    *[False, False, True, False, False, True],  # step 2 needs 3 rounds
    *[False] * 6,  # step 3 finds no spread: its last round tops up
    *[True, True],  # step 4: one round
    *[False, True, True, True],  # step 5: two, with a surplus group
]


def _sampled_ahead(
    k: int, steps: int, *, start: int = 0, state=None, stop_after=None, score_ahead=False
):
    """The recipe's loop over the source with dynamic sampling: take the groups, (train), sync.
    The step results, the task (its prompt stream) and, when stopped, the checkpoint."""
    task = ScriptedTask(STEPS_SPREAD)
    task.drawn = 0 if state is None else state["drawn"]
    source = RolloutSource(
        ScriptedWorker(start),
        task,
        PARAMS,
        random.Random(0),
        2,
        max_staleness=k,
        last_step=steps,
        limits=RolloutConfig(dynamic_sampling=True, max_sampling_rounds=3),
        state=state and state["ahead"],
        pad_token_id=ScriptedSampler().tokenizer.pad_token_id,
        score_ahead=score_ahead,
    )
    results = {}
    for step in range(start + 1, steps + 1):
        results[step] = source.take(step)
        source.sync(engine=None)
        if step == stop_after:
            saved = {"ahead": source.state_dict(), "drawn": task.drawn}
            source.close()
            return results, task, saved
    source.close()
    return results, task, None


@pytest.mark.parametrize(
    ("k", "waited", "score_ahead"),
    [(1, [0, 1, 1, 0, 1], False), (2, [0, 0, 0, 0, 1], False), (1, [0, 1, 1, 0, 1], True)],
)
def test_rounds_sampled_ahead_keep_what_the_synchronous_filter_keeps(
    k, waited, score_ahead
) -> None:
    """Also with the rounds collected and scored in the background thread (score_ahead)."""
    steps = 5
    ahead, task, _ = _sampled_ahead(k, steps, score_ahead=score_ahead)
    sync_task, sync_sampler = ScriptedTask(STEPS_SPREAD), ScriptedSampler()
    for step in range(1, steps + 1):
        expected = _synchronous(sync_task, sync_sampler, 2, max_rounds=3)
        got = ahead[step]
        assert _prompt_numbers(got) == _prompt_numbers(expected), step
        for key in expected.rollout.batch.keys():  # noqa: SIM118 (a TensorDict iterates rows)
            if key != POLICY_VERSION_KEY:  # (the synchronous rounds: version 0)
                assert torch.equal(got.rollout.batch[key], expected.rollout.batch[key]), key
        assert got.rollout.texts == expected.rollout.texts
        assert torch.equal(got.scores, expected.scores)
        metrics = {k: v for k, v in got.metrics.items() if k.startswith("dynamic_sampling/")}
        assert metrics.pop("dynamic_sampling/rounds_waited") == waited[step - 1]
        assert metrics == expected.metrics
        # Nothing older than k is trained: the trainer is at version step - 1.
        versions = got.rollout.batch[POLICY_VERSION_KEY]
        assert 0 <= (step - 1) - int(versions.min()) <= k
    assert [ahead[s].metrics["dynamic_sampling/rounds"] for s in ahead] == [1, 3, 3, 1, 2]
    assert ahead[3].metrics["dynamic_sampling/groups_filled"] == 2.0  # the cap's top-up
    assert ahead[5].metrics["dynamic_sampling/groups_surplus"] == 1.0
    # Every round drawn was filtered by a step: none sampled ahead was left over.
    assert task.drawn == sync_task.drawn == len(STEPS_SPREAD)


def test_with_k1_the_next_steps_round_is_sampled_while_a_step_trains() -> None:
    """Every step needs two rounds (one spread group per round of two prompts). The rounds a
    step took are replaced before it trains, with the weights it trains from, so the worker
    samples one while the trainer trains and the next step trains on it one version stale.
    (Replaced only after the next push, all were sampled after it, while the trainer waited:
    staleness 0 on every step.)"""
    steps = 4
    task, worker = ScriptedTask([True, False] * 2 * steps), ScriptedWorker()
    source = RolloutSource(
        worker,
        task,
        PARAMS,
        random.Random(0),
        2,
        max_staleness=1,
        last_step=steps,
        limits=RolloutConfig(dynamic_sampling=True, max_sampling_rounds=3),
        pad_token_id=ScriptedSampler().tokenizer.pad_token_id,
    )
    queued, staleness = [], []
    for step in range(1, steps + 1):
        result = source.take(step)
        assert result.metrics["dynamic_sampling/rounds"] == 2.0
        queued.append(len(worker.jobs))  # what the worker samples while the step trains
        staleness.append(result.metrics["staleness/max"])
        source.sync(engine=None)
    source.close()
    assert queued == [1, 1, 1, 0]  # none past the last step
    assert staleness == [0.0, 1.0, 1.0, 1.0]
    assert task.drawn == 2 * 2 * steps  # every round drawn was trained on


def test_a_restored_source_filters_the_rounds_it_held() -> None:
    full, _, _ = _sampled_ahead(2, 5)
    first, _, state = _sampled_ahead(2, 5, stop_after=3)
    # After step 3 (k = 2): the rounds of steps 4 and 5, at the latest, are held.
    assert [item["step"] for item in state["ahead"]["items"]] == [4, 5]
    second, task, _ = _sampled_ahead(2, 5, start=3, state=state)
    for step, result in {**first, **second}.items():
        assert _prompt_numbers(result) == _prompt_numbers(full[step])
        assert {**result.metrics, "staleness/take_wait_s": 0} == {
            **full[step].metrics,
            "staleness/take_wait_s": 0,  # a duration
        }
    assert task.drawn == len(STEPS_SPREAD)


# ============================================================================ data parallel


@pytest.mark.distributed
@pytest.mark.slow
def test_every_rank_runs_the_rounds_the_neediest_rank_needs(tmp_path: Path) -> None:
    from distributed_utils import launch

    launch(2, HERE, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    enough, capped = (0, 1), (2, 3)
    # Rank 0 had its groups after round 1 but sampled rounds 2 and 3 with rank 1.
    assert [ranks[r]["calls"] for r in range(2)] == [3, 3]
    assert ranks[0]["prompts"][0] == list(enough) and ranks[1]["prompts"][0] == [2, 5]
    metrics = {
        "dynamic_sampling/rounds": 3.0,
        "dynamic_sampling/groups_dropped": 4.0,  # rank 1: 2 + 1 + 1
        "dynamic_sampling/groups_filled": 0.0,
        "dynamic_sampling/groups_surplus": 4.0,  # rank 0: rounds 2 and 3
    }
    assert ranks[0]["metrics"][0] == ranks[1]["metrics"][0] == metrics
    # At the cap only rank 1 tops up, from its last round.
    assert ranks[0]["prompts"][1] == list(enough) and ranks[1]["prompts"][1] == list(capped)
    metrics = {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/groups_dropped": 2.0,
        "dynamic_sampling/groups_filled": 2.0,
        "dynamic_sampling/groups_surplus": 2.0,
    }
    assert ranks[0]["metrics"][1] == ranks[1]["metrics"][1] == metrics


def _rank_main(tmp: Path) -> None:
    dist_info = Dist.init()
    rank = dist_info.rank
    assert dist_info.world_size == 2
    # Rank 0's groups all have a spread; rank 1 finds one in round 2 and one in round 3, or
    # (the second case, capped at 2 rounds) none.
    cases = [
        ([True] * 6 if rank == 0 else [False, False, True, False, False, True], 4),
        ([True] * 4 if rank == 0 else [False] * 4, 2),
    ]
    out = {"calls": 0, "prompts": [], "metrics": []}
    for spread, max_rounds in cases:
        result, sampler = _run(spread, 2, max_rounds, dist_info)
        _check_is_sampled_directly(result, 2)
        out["calls"] = out["calls"] or sampler.calls
        out["prompts"].append(_prompt_numbers(result))
        out["metrics"].append(result.metrics)
    dist_info.barrier()
    (tmp / f"rank{rank}.json").write_text(json.dumps(out))
    dist_info.close()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
