"""The recipes on a vision-language policy (microrl/run/vision.py, the hf backend): a task whose
prompts carry images trains end to end, and what cannot take images is refused at start.

A tiny Qwen2-VL saved to the test's folder (tests/vlm_utils.py) and an in-test task whose
problems alternate between a picture and plain text, passed in place of ``make_task``.
"""

from __future__ import annotations

import random

import pytest
from example_utils import TINY_RL
from vlm_utils import IMAGE, picture, save_tiny_vlm

import microrl.run.loop
from microrl.recipes import grpo, ppo
from microrl.run import read_metrics
from microrl.tasks import Problem


class PictureTask:
    """``a+1=`` after a picture (even problems) or alone (odd ones), both in every batch;
    reward: the response's length (it differs within a group: the updates move the policy)."""

    solved_threshold = 1.0

    def problem(self, i: int) -> Problem:
        a = i % 5
        if i % 2:
            return Problem(f"{a}+1=", str(a + 1))
        return Problem(f"{IMAGE}{a}+1=", str(a + 1), images=(picture(8, 8, i),))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problem(2 * rng.randrange(50) + k % 2) for k in range(n)]

    def eval_problems(self) -> list[Problem]:
        return [self.problem(i) for i in range(2)]

    def score(self, responses, problems) -> list[float]:
        return [len(r) / 4 for r in responses]


def args(tmp_path, *extra: str) -> list[str]:
    return [
        *TINY_RL,
        f"model.path={tmp_path / 'vlm'}",
        f"output.dir={tmp_path / 'out'}",
        "output.plot=false",
        "output.tensorboard=false",
        "output.progress=false",
        "rollout.max_new_tokens=3",
        "train.steps=2",
        *extra,
    ]


class GuessEnv:
    """Two turns: a text hint after the first, the second turn's length as the reward."""

    def __init__(self) -> None:
        self.turns = 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str):
        self.turns += 1
        done = self.turns == 2
        hint = [] if done else [{"role": "user", "content": "+"}]
        return {"observations": hint, "reward": len(action) / 4 if done else 0.0, "done": done}


class EpisodePictureTask(PictureTask):
    """:class:`PictureTask` played as episodes: the first input carries the picture."""

    def make_env(self, problem: Problem) -> GuessEnv:
        return GuessEnv()


@pytest.fixture
def picture_task(tmp_path, monkeypatch):
    save_tiny_vlm(tmp_path / "vlm")
    monkeypatch.setattr(microrl.run.loop, "make_task", lambda cfg, tokenizer, **_: PictureTask())


@pytest.mark.parametrize("recipe", [grpo, ppo], ids=["grpo", "ppo"])
def test_a_task_with_images_trains_on_the_hf_backend(recipe, tmp_path, picture_task) -> None:
    assert recipe.main(args(tmp_path)) == 0
    _check_steps(tmp_path)


def test_a_task_with_images_trains_asynchronously_on_an_hf_worker(tmp_path, picture_task) -> None:
    """The images travel with the jobs to the worker process (the task stays here), which
    encodes them as the trainer does: step 1's rollout (sampled with the weights it trains)
    has the synchronous path's image mismatch; step 2's is one version stale, its image rows
    no further off the policy than the batch."""
    assert grpo.main(args(tmp_path, "rollout.max_staleness=1")) == 0
    fresh, stale = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if r["step"] > 0]
    assert (fresh["staleness/max"], stale["staleness/max"]) == (0, 1)
    assert 0 <= fresh["mismatch/image/abs_diff_max"] <= 5e-5
    assert fresh["mismatch/image/kl_k3"] <= 1e-8
    assert 0 < stale["mismatch/image/abs_diff_max"] <= stale["mismatch/abs_diff_max"]
    assert all(r["grad_norm"] > 0 for r in (fresh, stale))


def test_episodes_with_images_train_on_the_hf_backend(tmp_path, monkeypatch) -> None:
    save_tiny_vlm(tmp_path / "vlm")
    monkeypatch.setattr(microrl.run.loop, "make_task", lambda cfg, tok, **_: EpisodePictureTask())
    assert grpo.main(args(tmp_path, "rollout.max_turns=2", "rollout.max_episode_tokens=8")) == 0
    _check_steps(tmp_path)


def _check_steps(tmp_path) -> None:
    steps = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if r["step"] > 0]
    assert len(steps) == 2
    for record in steps:  # the image rows' own mismatch, as small as the whole batch's
        assert record["grad_norm"] > 0
        assert 0 <= record["mismatch/image/abs_diff_max"] <= 5e-5
        assert record["mismatch/image/kl_k3"] <= 1e-8
        assert "eval/accuracy" in record or record["step"] == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["rollout.backend=vllm"], "rollout.backend must be hf for prompts with images on this"),
        (
            ["rollout.backend=vllm", "rollout.max_staleness=1"],
            r"rollout.backend must be hf for prompts with images on this machine: ",
        ),
        (["teacher.path={vlm}"], "teacher.path must be empty for a task with images .*teacher"),
    ],
)
def test_samplers_without_images_are_refused_at_start(extra, message, tmp_path, picture_task):
    extra = [e.format(vlm=tmp_path / "vlm") for e in extra]
    with pytest.raises(ValueError, match=message):
        grpo.main(args(tmp_path, *extra))


def test_a_text_policy_given_images_is_refused_naming_the_keys(tmp_path, monkeypatch) -> None:
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model, build_tokenizer

    tokenizer = build_tokenizer(
        extra_tokens=["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    )
    model = build_model(
        ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2), tokenizer
    )
    model.save_pretrained(tmp_path / "vlm")
    tokenizer.save_pretrained(tmp_path / "vlm")
    monkeypatch.setattr(microrl.run.loop, "make_task", lambda cfg, tokenizer, **_: PictureTask())
    with pytest.raises(
        ValueError,
        match=r"task.name=addition gives prompts with images but model.path=.*vlm has no vision config",
    ):
        grpo.main(args(tmp_path))
