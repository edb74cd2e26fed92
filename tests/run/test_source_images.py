"""Image prompts sampled ahead (microrl/run/source.py): each job carries its problems'
images, and a checkpoint keeps the problems sampled ahead with their images (lossless PNG), so
a restored source trains on the very prompts and pixels an uninterrupted one does."""

from __future__ import annotations

import io
import random

import torch
from PIL import Image
from tensordict import TensorDict

from microrl.rollout import Rollout, SamplingParams
from microrl.rollout.sampler import POLICY_VERSION_KEY, Job
from microrl.run import RolloutSource
from microrl.tasks import Problem

PARAMS = SamplingParams(num_samples=2, max_new_tokens=3)


def _picture(i: int) -> Image.Image:
    """An image per problem, in a mode a lossy or RGB-only round trip would change."""
    gen = torch.Generator().manual_seed(i)
    pixels = torch.randint(0, 256, (4 + i % 3, 6, 4), generator=gen, dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy(), mode="RGBA")
    return image.convert("L") if i % 2 else image


class ImageTask:
    """``<img>i=`` after a picture of its own (every third problem: text only)."""

    solved_threshold = 1.0

    def problem(self, i: int) -> Problem:
        if i % 3 == 0:
            return Problem(f"{i}=", str(i))
        return Problem(f"<img>{i}=", str(i), images=(_picture(i),))

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.problem(rng.randrange(100)) for _ in range(n)]

    def eval_problems(self) -> list[Problem]:
        return [self.problem(1)]

    def score(self, responses, problems) -> list[float]:
        return [float(r == p.answer) for r, p in zip(responses, problems, strict=True)]


class ImageWorker:
    """A stand-in asynchronous sampler: records each job's images; answers every prompt."""

    trainer_thread = samples_at_collect = False

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.sync_stats: dict = {}
        self.jobs: dict[int, tuple[int, list[str]]] = {}
        self.images: list = []  # per submitted job: its images argument

    def submit(self, prompts, params, *, images=None) -> Job:
        job = Job(len(self.jobs) + len(self.images), self.version, "generate")
        self.jobs[job.id] = (self.version, list(prompts))
        self.images.append(images)
        return job

    def sync(self, engine) -> None:
        self.version += 1

    def poll(self) -> None:
        pass

    def collect(self, job: Job) -> Rollout:
        version, prompts = self.jobs.pop(job.id)
        rows = len(prompts) * PARAMS.num_samples
        answers = [p.split(">")[-1].rstrip("=") for p in prompts for _ in range(2)]
        batch = TensorDict(
            {
                "input_ids": torch.ones(rows, 4, dtype=torch.long),
                "loss_mask": torch.ones(rows, 4, dtype=torch.bool),
                POLICY_VERSION_KEY: torch.full((rows,), version, dtype=torch.long),
            },
            batch_size=[rows],
        )
        return Rollout(batch=batch, texts=answers, group_ids=torch.arange(rows) // 2)

    def close(self) -> None:
        pass


def _pixels(problems) -> list:
    return [[(i.mode, i.size, i.tobytes()) for i in p.images] for p in problems]


def _pixels_of(images) -> list:
    rows = images or [[], [], []]
    return [[(i.mode, i.size, i.tobytes()) for i in row] for row in rows]


def _run(steps: int, *, start: int = 0, state=None, stop_after: int | None = None):
    """Per step: the prompts and images trained; the worker; the state at ``stop_after``."""
    worker, rng = ImageWorker(start), random.Random(3)
    if state is not None:
        rng.setstate(state["rng"])
    source = RolloutSource(
        worker,
        ImageTask(),
        PARAMS,
        rng,
        3,
        max_staleness=2,
        last_step=steps,
        state=state and state["ahead"],
    )
    trained = {}
    for step in range(start + 1, steps + 1):
        problems, _, scores, _ = source.take(step)
        assert scores.tolist() == [1.0] * len(scores)
        trained[step] = ([p.prompt for p in problems], _pixels(problems))
        source.sync(engine=None)
        if step == stop_after:
            saved = {"ahead": source.state_dict(), "rng": rng.getstate()}
            source.close()
            return trained, worker, saved
    source.close()
    return trained, worker, None


def test_jobs_carry_their_problems_images_and_a_restored_run_trains_the_same_pixels() -> None:
    steps = 5
    full, worker, _ = _run(steps)
    sent = [images for images in worker.images if images is not None]  # None: a text job
    assert sent and all(len(images) == 3 for images in sent)  # one list per prompt
    for step, images in enumerate(worker.images, 1):
        assert _pixels_of(images) == full[step][1]
    first, _, state = _run(steps, stop_after=2)
    buffer = io.BytesIO()
    torch.save(state["ahead"], buffer)  # as save_run writes it, load_run reads it
    buffer.seek(0)
    state["ahead"] = torch.load(buffer, weights_only=True)
    second, _, _ = _run(steps, start=2, state=state)
    assert {**first, **second} == full  # the same prompts and pixels (mode, size, bytes)
    assert any(any(rows) for step in (3, 4) for rows in second[step][1])  # restored ones had images
