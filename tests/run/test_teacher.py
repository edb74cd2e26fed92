"""The teacher of on-policy distillation (microrl/run/teacher.py, microrl/run/distill.py).

The engine teacher's log-probs and the mixed advantages against a float64 hand computation from
the teacher's own logits, under micro-batch splits and on 2 gloo ranks (one launch of this file;
single-process references computed in the test; only rank 0 reads the checkpoint); the
vocabulary check; ``teacher.path`` as a Hub id (the download stubbed: no network) or a missing
path; the config's errors; the scoring of the rollout source's rounds
(microrl/run/source.py's ``scorer``).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for the ranks
from distributed_utils import actor_config, launch, make_batch, tiny_model  # noqa: E402

from microrl.configs.endpoint import EndpointConfig  # noqa: E402
from microrl.configs.teacher import TeacherConfig  # noqa: E402
from microrl.run.dist import Dist  # noqa: E402
from microrl.run.distill import mix_teacher_advantages  # noqa: E402
from microrl.run.teacher import EngineTeacher, check_same_vocabulary  # noqa: E402

TEMPERATURE = 0.7
# float32 forward against the float64 reference of the same weights (logits ~1, vocab 128).
ATOL = 2e-5


def _teacher_dir(root: Path) -> Path:
    path = root / "teacher"
    if not (path / "config.json").is_file():
        tiny_model(seed=3).save_pretrained(path)
    return path


@torch.no_grad()
def _reference_logprobs(path: Path, batch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each sampled token, float64, row by row without padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).double().eval()
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    for b in range(batch.batch_size[0]):
        keep = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][keep].unsqueeze(0)
        logp = torch.log_softmax(model(input_ids=ids).logits[0] / temperature, -1)
        cols = keep.nonzero().squeeze(-1)
        out[b, cols[1:]] = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.where(batch["loss_mask"].bool(), out, 0.0)


def _reference_advantages(teacher_lp, student_lp, mask, task, coef, gamma) -> torch.Tensor:
    out = task.double().clone()
    for b in range(mask.shape[0]):
        cols = mask[b].nonzero().squeeze(-1).tolist()
        rewards = [float(teacher_lp[b, t]) - float(student_lp[b, t]) for t in cols]
        for k, t in enumerate(cols):
            out[b, t] += coef * sum(gamma**j * r for j, r in enumerate(rewards[k:]))
    return out


def _score(path: Path, batch, micro_batch_size: int, gamma: float = 0.5):
    config = TeacherConfig(
        path=str(path), temperature=TEMPERATURE, micro_batch_size=micro_batch_size, gamma=gamma
    )
    teacher = EngineTeacher(config, actor_config(temperature=1.3))  # the student's: unused T
    batch = batch.clone()
    task = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(2))
    advantages, metrics = mix_teacher_advantages(
        batch, task * batch["loss_mask"], config, teacher, Dist()
    )
    return batch["teacher_logprobs"], advantages, metrics, task * batch["loss_mask"]


@pytest.mark.parametrize("micro_batch_size", [1, 3, 7])
def test_engine_teacher_and_mixed_advantages_match_float64(tmp_path, micro_batch_size) -> None:
    path, batch = _teacher_dir(tmp_path), make_batch()
    teacher_lp, advantages, metrics, task = _score(path, batch, micro_batch_size)
    expected_lp = _reference_logprobs(path, batch, TEMPERATURE)
    torch.testing.assert_close(teacher_lp.double(), expected_lp, rtol=0, atol=ATOL)
    mask = batch["loss_mask"].bool()
    expected = _reference_advantages(expected_lp, batch["old_logprobs"], mask, task, 1.0, 0.5)
    torch.testing.assert_close(advantages.double(), expected, rtol=0, atol=4 * ATOL)
    kl = (batch["old_logprobs"].double() - expected_lp)[mask].mean()
    assert metrics["teacher/reverse_kl"] == pytest.approx(float(kl), abs=ATOL)
    assert metrics["teacher/wait_s"] > 0


def test_engine_teacher_is_the_same_under_any_micro_batch_split(tmp_path) -> None:
    path, batch = _teacher_dir(tmp_path), make_batch()
    whole = _score(path, batch, 7)[:2]
    for size in (1, 2):
        for got, ref in zip(_score(path, batch, size)[:2], whole, strict=True):
            # the same fp32 forward on other padded widths: rounding only
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_pure_distillation_drops_the_task_advantage(tmp_path) -> None:
    path, batch = _teacher_dir(tmp_path), make_batch()
    config = TeacherConfig(path=str(path), task_reward=False, coef=2.0)
    teacher = EngineTeacher(config, actor_config())
    task = torch.full(batch["loss_mask"].shape, 5.0)
    advantages, _ = mix_teacher_advantages(batch.clone(), task, config, teacher, Dist())
    mask = batch["loss_mask"].bool()
    expected_lp = _reference_logprobs(path, batch, 1.0)
    expected = 2.0 * (expected_lp - batch["old_logprobs"].double())
    torch.testing.assert_close(advantages.double()[mask], expected[mask], rtol=0, atol=2 * ATOL)


# ----------------------------------------------------------------------------- 2 gloo ranks
@pytest.mark.distributed
def test_teacher_advantages_on_two_ranks_equal_the_float64_reference(tmp_path) -> None:
    path, batch = _teacher_dir(tmp_path), make_batch()
    launch(2, HERE, str(tmp_path))
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # Loaded as the student is: rank 0 reads the checkpoint, rank 1 builds on meta (before,
    # every rank loaded the whole teacher and moved it to its device before sharding).
    assert [p["checkpoint_reads"] for p in parts] == [1, 0]
    assert parts[0]["metrics"] == parts[1]["metrics"]  # summed over ranks: the same on both
    teacher_lp = torch.cat([p["teacher"] for p in parts])
    advantages = torch.cat([p["advantages"] for p in parts])
    expected_lp = _reference_logprobs(path, batch, TEMPERATURE)
    torch.testing.assert_close(teacher_lp.double(), expected_lp, rtol=0, atol=ATOL)
    mask = batch["loss_mask"].bool()
    task = torch.cat([p["task"] for p in parts])
    expected = _reference_advantages(expected_lp, batch["old_logprobs"], mask, task, 1.0, 0.5)
    torch.testing.assert_close(advantages.double(), expected, rtol=0, atol=4 * ATOL)
    kl = (batch["old_logprobs"].double() - expected_lp)[mask].mean()
    assert parts[0]["metrics"]["teacher/reverse_kl"] == pytest.approx(float(kl), abs=ATOL)


def _rank_main(root: Path) -> None:
    """Each rank scores its contiguous half of the batch with an FSDP2-sharded teacher, and
    counts the checkpoints it read from disk."""
    from transformers import PreTrainedModel

    dist_info = Dist.init()
    reads, from_pretrained = [0], PreTrainedModel.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        reads[0] += 1
        return from_pretrained(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(counted)
    rows = make_batch()[dist_info.shard(list(range(7)))]
    config = TeacherConfig(path=str(root / "teacher"), temperature=TEMPERATURE, gamma=0.5)
    teacher = EngineTeacher(config, actor_config(micro_batch_size=2))
    gen = torch.Generator().manual_seed(2)
    task = torch.randn(7, 12, generator=gen)[dist_info.shard(list(range(7)))] * rows["loss_mask"]
    advantages, metrics = mix_teacher_advantages(rows, task, config, teacher, dist_info)
    metrics.pop("teacher/wait_s")
    result = {"teacher": rows["teacher_logprobs"], "advantages": advantages, "task": task}
    result["checkpoint_reads"] = reads[0]
    torch.save({**result, "metrics": metrics}, root / f"rank{dist_info.rank}.pt")
    dist_info.close()


# ----------------------------------------------------------------------------- vocabularies
def test_a_teacher_with_another_vocabulary_is_refused() -> None:
    from microrl.run.toy_model import build_tokenizer

    student = build_tokenizer()
    check_same_vocabulary(student, build_tokenizer(), "same")  # the same: accepted
    with pytest.raises(ValueError) as err:
        check_same_vocabulary(student, build_tokenizer("xyz"), "bigger-teacher")
    message = str(err.value)
    assert "teacher.path='bigger-teacher'" in message
    assert f"has {len(student.get_vocab())} tokens" in message
    assert f") {len(student.get_vocab()) + 3}; " in message  # the teacher's size
    assert "the teacher's token 'x'" in message and "not in the student's" in message
    swapped = dict(student.get_vocab())
    first, second = sorted(swapped, key=swapped.get)[:2]
    swapped[first], swapped[second] = swapped[second], swapped[first]
    other = SimpleNamespace(get_vocab=lambda: swapped)
    with pytest.raises(ValueError, match=rf"token {first!r} is id 0 in the student's and 1 in"):
        check_same_vocabulary(student, other, "swapped")


# ----------------------------------------------------------------------------- teacher.path
HUB_ID = "Org/teacher-7b"


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """``huggingface_hub.snapshot_download`` answering from a local "cache" that holds a toy
    teacher (the student's tokenizer); each call's arguments. No network: offline mode is on,
    so a Hub id read any other way fails rather than reaching the Hub."""
    import huggingface_hub
    from huggingface_hub import constants

    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model, build_tokenizer

    for module in {constants, sys.modules[huggingface_hub.is_offline_mode.__module__]}:
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    snapshot, tokenizer = tmp_path / "hf-cache" / "snapshot", build_tokenizer()
    tiny = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, seed=1)
    build_model(tiny, tokenizer).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    asked: list[dict] = []

    def snapshot_download(repo_id: str, **kwargs) -> str:
        asked.append({"repo_id": repo_id, **kwargs})
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)  # nothing named Org/ here: the id is no local path
    return asked


class FakeDist:
    """A :class:`Dist` of 2 ranks as ``rank`` sees it: its collective ``any`` recorded."""

    def __init__(self, rank: int, events: list[str]) -> None:
        self.is_main, self.events = rank == 0, events

    def any(self, flag: bool) -> bool:
        self.events.append("wait")
        return flag


def test_a_hub_teacher_is_downloaded_once_then_scores(fake_hub, monkeypatch) -> None:
    """The distillation preset's ``teacher.path=Qwen/Qwen2.5-7B-Instruct`` failed at start
    ("not a local checkpoint directory"): the download was never called. Now the main process
    downloads it, the others wait and find it in the cache, and the engine loads the snapshot."""
    import huggingface_hub

    from microrl.run.teacher import make_teacher
    from microrl.run.toy_model import build_tokenizer

    config = TeacherConfig(path=HUB_ID)
    events: list[str] = []
    download = huggingface_hub.snapshot_download

    def recorded(repo_id: str, **kwargs) -> str:
        events.append("download")
        return download(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recorded)
    teachers = [
        make_teacher(config, actor_config(), build_tokenizer(), dist_info=FakeDist(rank, events))
        for rank in (0, 1)
    ]
    assert events == ["download", "wait", "wait", "download"]  # rank 1 after the wait
    assert [a["repo_id"] for a in fake_hub] == [HUB_ID, HUB_ID]
    assert "*.safetensors" in fake_hub[0]["allow_patterns"]  # the weights: scored here
    lp = teachers[0].score(_toy_batch())
    assert lp.shape == (2, 6) and bool((lp[:, 3:] < 0).all())


def _toy_batch():
    from tensordict import TensorDict

    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]])
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 3:] = True
    attention = torch.ones_like(loss_mask)
    return TensorDict(input_ids=ids, attention_mask=attention, loss_mask=loss_mask, batch_size=[2])


def test_a_served_hub_teacher_downloads_only_its_tokenizer(fake_hub) -> None:
    from microrl.run.teacher import VLLMTeacher, make_teacher
    from microrl.run.toy_model import build_tokenizer

    url = "http://127.0.0.1:9"  # never reached: the client connects on the first request
    config = TeacherConfig(path=HUB_ID, backend="vllm", server=EndpointConfig(url=url))
    teacher = make_teacher(config, actor_config(), build_tokenizer())
    assert isinstance(teacher, VLLMTeacher) and teacher.server is None
    ((asked,),) = [fake_hub]
    assert not any("safetensors" in p or "bin" in p for p in asked["allow_patterns"])
    teacher.close()


@pytest.mark.parametrize("kind", ["missing", "empty-dir"])
def test_a_bad_local_teacher_path_names_the_key(fake_hub, tmp_path, kind) -> None:
    """Before: a raw Hub ``OSError`` (or ``HFValidationError``) naming neither the key nor
    what to do."""
    from microrl.run.teacher import make_teacher
    from microrl.run.toy_model import build_tokenizer

    path = tmp_path / "models" / "teacher"
    if kind == "empty-dir":
        path.mkdir(parents=True)
    with pytest.raises(ValueError) as err:
        make_teacher(TeacherConfig(path=str(path)), actor_config(), build_tokenizer())
    message = str(err.value)
    assert message.startswith(f"teacher.path={str(path)!r} ")
    expected = "does not exist" if kind == "missing" else "holds no transformers checkpoint"
    assert expected in message and "Hugging Face Hub id" in message
    assert fake_hub == []  # a local path is never a download


# ----------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["teacher.backend=tpu"], "teacher.backend must be one of engine, vllm"),
        (["teacher.coef=-1"], "teacher.coef must be a finite float >= 0"),
        (["teacher.gamma=2"], r"teacher.gamma must be in \[0, 1\]"),
        (["teacher.temperature=0"], "teacher.temperature must be > 0"),
        (["teacher.task_reward=false"], "teacher.task_reward must be true without a teacher"),
        (
            ["teacher.path=t", "teacher.task_reward=false", "teacher.coef=0"],
            "teacher.coef must be > 0 with teacher.task_reward=false",
        ),
        (
            ["teacher.path=t", "teacher.backend=vllm", "teacher.temperature=0.5"],
            "teacher.temperature must be 1.0 with teacher.backend=vllm",
        ),
        (["teacher.path=t", "teacher.server.url=http://h:1"], "teacher.server.url must be empty"),
        (
            ["teacher.path=t", "teacher.backend=vllm", "teacher.server.url=h:1"],
            "teacher.server.url must be an http",
        ),
        (
            ["teacher.path=t", "task.name=hinted_addition"],
            "teacher.path must be empty with task.name=hinted_addition or env",
        ),
    ],
)
def test_teacher_config_errors_name_the_key(overrides, match: str) -> None:
    from microrl.configs.examples import GRPOExampleConfig
    from microrl.configs.loader import load_config

    with pytest.raises(ValueError, match=match):
        load_config(GRPOExampleConfig, None, overrides)


# ----------------------------------------------------------------------------- in the producer
class ScoredWorker:
    """The sampler protocol's minimum for a rollout source: a job's rows answer its prompts."""

    trainer_thread = samples_at_collect = False

    def __init__(self) -> None:
        from microrl.rollout import SamplingParams

        self.version, self.sync_stats, self.jobs = 0, {}, {}
        self.params = SamplingParams(num_samples=2, max_new_tokens=3)

    def submit(self, prompts, params):
        from microrl.rollout.sampler import Job

        job = Job(len(self.jobs), self.version, "generate")
        self.jobs[job.id] = list(prompts)
        return job

    def collect(self, job):
        from tensordict import TensorDict

        from microrl.rollout import Rollout
        from microrl.rollout.sampler import POLICY_VERSION_KEY

        prompts = self.jobs.pop(job.id)
        texts = [str(eval(p.rstrip("="))) for p in prompts for _ in range(2)]
        rows = len(texts)
        batch = TensorDict(
            {
                "input_ids": torch.ones(rows, 4, dtype=torch.long),
                POLICY_VERSION_KEY: torch.zeros(rows, dtype=torch.long),
            },
            batch_size=[rows],
        )
        return Rollout(batch=batch, texts=texts, group_ids=torch.arange(rows) // 2)

    def poll(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("background", [True, False])
def test_rounds_are_scored_by_the_sources_thread_while_the_trainer_works(background) -> None:
    """A teacher scorer runs on the source's scoring thread (or, collective, on the
    trainer's), before the rewards; ``scorer_wait_s`` is the part of a take's wait it took."""
    from microrl.run import RolloutSource
    from microrl.tasks import AdditionTask

    threads = []

    def score(rollout) -> None:
        threads.append(threading.current_thread().name)
        time.sleep(0.2)
        rollout.batch["teacher_logprobs"] = torch.zeros(rollout.batch["input_ids"].shape)

    worker = ScoredWorker()
    source = RolloutSource(
        worker, AdditionTask(9, 8), worker.params, random.Random(0), 2,
        max_staleness=1, last_step=2, score_ahead=background, scorer=score,
    )  # fmt: skip
    time.sleep(0.4)  # the trainer trains meanwhile
    _, rollout, scores, _ = source.take(1)
    assert "teacher_logprobs" in rollout.batch and scores.tolist() == [1.0] * 4
    if background:
        assert source.scorer_wait_s < 0.1 and threads[0].startswith("microrl-score")
    else:
        assert source.scorer_wait_s >= 0.2 and threads[0] == threading.current_thread().name
    source.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _rank_main(Path(sys.argv[1]))
