"""A scalar reward model as a reward term (microrl/tasks/reward_model.py): its scores against a
plain transformers forward in float64, the same under any batch size, a LoRA-trained
``RewardModelEngine`` scored as the engine scores (its export, or its engine checkpoint with
``task.reward_model.base``), the normalisations, the weights that
combine it with reward functions, and the errors that name the key.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from model_reward_utils import save_reward_model, train_reward_model_engine
from tensordict import TensorDict
from transformers import AutoModelForSequenceClassification

from microrl.configs import EngineConfig
from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.engine.checkpoint.export import export_merged_model
from microrl.run.toy_model import build_tokenizer
from microrl.tasks import make_task
from microrl.tasks.reward_model import RewardModelScorer, normalise

PROMPTS = ["12+7=", "3+4=", "99+1=", "5+5=", "0+0="]
COMPLETIONS = ["19", "7", "100", "1", "0000000"]  # lengths 1-7: padding in every batch
# A 1-layer, 32-wide float32 forward (~100 roundings of O(1) values) against float64: 1e-5.
ATOL = 1e-5
RM_ATOL = 2e-5  # a trained RewardModelEngine's scores, engine vs scorer (see the test)


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=3)


def _reference(path, texts) -> torch.Tensor:
    """One unpadded float64 forward per text: the reward model's score, nothing else."""
    model = AutoModelForSequenceClassification.from_pretrained(path).double().eval()
    tokenizer = build_tokenizer()
    with torch.no_grad():
        return torch.stack([model(**tokenizer(t, return_tensors="pt")).logits[0, 0] for t in texts])


def test_scores_equal_a_plain_forward_under_any_batch_size(rm_path) -> None:
    expected = _reference(rm_path, [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    assert expected.std() > 0.1  # the rows score differently: a mix-up would show
    for batch_size in (1, 2, 5):
        scorer = RewardModelScorer(rm_path, batch_size=batch_size)
        got = torch.tensor(scorer(COMPLETIONS, PROMPTS), dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        metrics = scorer.drain_metrics()
        assert metrics["reward_model/rows"] == 5
        assert metrics["reward_model/score_sum"] == pytest.approx(float(expected.sum()), abs=1e-4)
        assert scorer.drain_metrics()["reward_model/rows"] == 0  # drained


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    """A LoRA RewardModelEngine trained one step, its engine checkpoint, and its export."""
    root = tmp_path_factory.mktemp("engine_rm")
    engine, base, ckpt = train_reward_model_engine(root)
    export_merged_model(engine.module, root / "export", tokenizer=build_tokenizer())
    return engine, base, ckpt, root / "export"


def _engine_scores(engine, texts, *, adapter: bool = True) -> torch.Tensor:
    enc = build_tokenizer()(list(texts), return_tensors="pt", padding=True)  # left padding
    batch = TensorDict(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"].bool(),
        batch_size=[len(texts)],
    )
    with engine.disable_adapter() if not adapter else contextlib.nullcontext():
        return engine.infer_batch(batch)["scores"].double()


def test_a_reward_model_engine_scores_as_the_engine_exported_or_from_its_checkpoint(
    trained_rm,
) -> None:
    """What RewardModelEngine trains (LoRA, one step) scores as the engine does, given as its
    export (export_merged_model) or as its engine checkpoint plus task.reward_model.base.

    Float32 on both sides, the engine left-padded with the adapter beside the frozen weight,
    the scorer right-padded with the adapter merged (in float64, rounded once): scores below 10
    (a float32 ulp <= 1e-6) differ by a few ulps (measured: 1e-6), so ``RM_ATOL`` = 2e-5."""
    engine, base, ckpt, export = trained_rm
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    expected = _engine_scores(engine, texts)
    # The test would see a dropped adapter or head: both move every score by far more than RM_ATOL.
    assert (expected - _engine_scores(engine, texts, adapter=False)).abs().min() > 1e-2
    assert expected.std() > 0.1
    for scorer in (
        RewardModelScorer(export, batch_size=2),
        RewardModelScorer(str(ckpt), base=str(base), batch_size=2),
    ):
        got = torch.tensor(scorer(COMPLETIONS, PROMPTS), dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=RM_ATOL, rtol=0)


def test_an_engine_checkpoint_as_task_reward_model(trained_rm, tmp_path) -> None:
    """The config path: task.reward_model.path=<engine checkpoint> task.reward_model.base=<base>."""
    from microrl.tasks import Problem

    engine, base, ckpt, _ = trained_rm
    task = _task(ckpt, tmp_path, "task.rewards.weights=[0.0,1.0]", f"task.reward_model.base={base}")
    problems = [Problem(p, "0") for p in PROMPTS]
    got = torch.tensor(task.score(COMPLETIONS, problems), dtype=torch.float64)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    torch.testing.assert_close(got, _engine_scores(engine, texts), atol=RM_ATOL, rtol=0)


def test_normalisations_against_a_hand_computation() -> None:
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 10.0], dtype=torch.float64)
    keys = ["a", "a", "b", "b", "c"]
    assert normalise(scores, "none", keys) is scores
    mean, std = 3.6, (sum((s - 3.6) ** 2 for s in scores.tolist()) / 5) ** 0.5
    torch.testing.assert_close(normalise(scores, "batch", keys), (scores - mean) / std)
    # a: (1, 3) -> (-1, 1); b: equal scores -> 0 (std floored); c: one row -> 0
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(normalise(scores, "group", keys), expected)


def _task(rm_path, tmp_path, *overrides):
    (tmp_path / "length.py").write_text(
        "def length(completions):\n    return [float(len(c)) for c in completions]\n"
    )
    args = [
        f"task.rewards.functions=[{tmp_path / 'length.py'}:length]",
        f"task.reward_model.path={rm_path}",
    ]
    cfg = load_config(
        GRPOExampleConfig, None, [*args, "task.max_operand=9", "task.eval_size=8", *overrides]
    )
    return make_task(cfg.task)


def test_weights_combine_the_reward_model_with_the_reward_functions(rm_path, tmp_path) -> None:
    """task.rewards.weights: [w_length, w_rm], in the order task.rewards, task.reward_model."""
    from microrl.tasks import Problem

    task = _task(
        rm_path, tmp_path, "task.rewards.weights=[0.5,2.0]", "task.reward_model.norm=group"
    )
    problems = [Problem(p, "0") for p in ["1+1=", "1+1=", "2+2=", "2+2="]]
    responses = ["2", "22", "4", "444"]
    raw = _reference(rm_path, [p.prompt + r for p, r in zip(problems, responses, strict=True)])
    rm = normalise(raw, "group", [p.prompt for p in problems])
    expected = 0.5 * torch.tensor([1.0, 2.0, 1.0, 3.0], dtype=torch.float64) + 2.0 * rm
    got = torch.tensor(task.score(responses, problems), dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=2 * ATOL, rtol=0)
    assert task.reward.drain_metrics()["reward_model/rows"] == 4


def test_chat_template_renders_the_reward_models_turns(rm_path) -> None:
    model = AutoModelForSequenceClassification.from_pretrained(rm_path)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    scorer = RewardModelScorer(model=model, tokenizer=tokenizer, chat_template=True)
    assert scorer.texts(["7"], ["3+4="]) == ["3+4==7="]
    expected = _reference(rm_path, ["3+4==7="])
    torch.testing.assert_close(
        torch.tensor(scorer(["7"], ["3+4="])).double(), expected, atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["task.rewards.weights=[1.0]"],
            r"one weight per reward term \(2: task.rewards.functions\[0\], task.reward_model\)",
        ),
        (["task.reward_model.norm=rank"], "task.reward_model.norm must be none, batch or group"),
        (["task.reward_model.batch_size=0"], "task.reward_model.batch_size must be >= 1"),
    ],
)
def test_bad_config_names_the_key(rm_path, tmp_path, overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        _task(rm_path, tmp_path, *overrides)


def test_bad_checkpoints_name_the_key(rm_path, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"task.reward_model.path='.*nowhere' could not be loaded"):
        RewardModelScorer(tmp_path / "nowhere")
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match=r"has 2 labels; a scalar reward model has 1"):
        RewardModelScorer(two)
    with pytest.raises(ValueError, match=r"reward_model.base=.* is set, but .* not an engine"):
        RewardModelScorer(rm_path, base=str(rm_path))
    with pytest.raises(
        ValueError, match=r"reward_model.chat_template=true, but .* no chat template"
    ):
        RewardModelScorer(rm_path, chat_template=True)


def test_the_reward_model_runs_on_the_processs_gpu(rm_path, monkeypatch) -> None:
    """On a (simulated) second GPU: chosen when built, in the caller's thread, as the engine's
    (``dtype=float32``: the exact scores; the default's bf16 is the next test's)."""
    from device_utils import simulated_cuda

    expected = RewardModelScorer(rm_path)(COMPLETIONS[:2], PROMPTS[:2])
    model = AutoModelForSequenceClassification.from_pretrained(rm_path)
    with simulated_cuda(monkeypatch, gpus=2):
        torch.cuda.set_device(1)
        scorer = RewardModelScorer(
            model=model, tokenizer=build_tokenizer(), engine_config=EngineConfig(dtype="float32")
        )
        assert scorer.device == torch.device("cuda", 1)
        assert next(scorer.engine.module.parameters()).device == torch.device("cuda", 1)
        got = scorer(COMPLETIONS[:2], PROMPTS[:2])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=ATOL, rtol=0)


# bf16 weights and activations (a relative 2^-8 each) through the 1-layer model, the score head
# in fp32: scores of order 1 move by ~1e-2 (measured 0.02 at most).
BF16_ATOL = 0.06


def test_the_reward_model_loads_in_the_runs_compute_dtype(rm_path, monkeypatch) -> None:
    """On a (simulated) GPU the run autocasts in bf16 (``actor.dtype=auto``): the reward model's
    weights are loaded straight into bf16 (never fp32 there), its score head stays fp32, and it
    scores under autocast; on the CPU (no autocast) everything stays fp32."""
    from device_utils import simulated_cuda

    from microrl.configs import ActorConfig

    cpu = RewardModelScorer(rm_path, engine_config=ActorConfig())
    assert {p.dtype for p in cpu.engine.module.parameters()} == {torch.float32}
    expected = _reference(rm_path, [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    with simulated_cuda(monkeypatch, gpus=1):
        scorer = RewardModelScorer(rm_path, engine_config=ActorConfig())
        dtypes = {n: p.dtype for n, p in scorer.engine.module.named_parameters()}
        assert dtypes.pop("value_head.weight") == torch.float32
        assert set(dtypes.values()) == {torch.bfloat16}
        got = torch.tensor(scorer(COMPLETIONS, PROMPTS), dtype=torch.float64)
    assert (got - expected).abs().max() > 1e-4  # it did compute in bf16
    torch.testing.assert_close(got, expected, atol=BF16_ATOL, rtol=0)


def test_a_frozen_reward_model_never_trains(rm_path) -> None:
    scorer = RewardModelScorer(rm_path)
    assert scorer.engine.optimizer is None
    assert not any(p.requires_grad for p in scorer.engine.module.parameters())
    with pytest.raises(RuntimeError, match=r"frozen \(frozen=True\): it only scores"):
        scorer.engine.train_batch(TensorDict(input_ids=torch.ones(1, 2, dtype=torch.long)))


def test_a_causal_lm_is_not_a_reward_model(tmp_path) -> None:
    """A checkpoint without a trained score head would score with a random one: refused."""
    from engine_utils import tiny_model

    tiny_model().save_pretrained(tmp_path / "lm")
    build_tokenizer().save_pretrained(tmp_path / "lm")
    with pytest.raises(
        ValueError, match=r"task.reward_model.path=.*not a \*ForSequenceClassification"
    ):
        RewardModelScorer(tmp_path / "lm")


def test_collective_reward_models_refuse_agents_and_are_not_scored_ahead(
    tmp_path, monkeypatch
) -> None:
    """Under torchrun the sharded reward model is a collective (Reward.collective): the
    asynchronous sampler scores it on the trainer thread, and an agent task refuses it."""
    from microrl.tasks.rewards import Reward

    class Sharded:
        collective = True

        def __call__(self, completions, prompts):
            return [0.0] * len(completions)

        def drain_metrics(self):
            return {}

    from microrl.run.session import scores_ahead
    from microrl.tasks import Problem
    from microrl.tasks.rewards import RewardedTask
    from microrl.tasks.word_problems import WordProblemTask

    local = Sharded()
    local.collective = False
    for fn, ahead in ((local, True), (Sharded(), False)):
        task = RewardedTask(WordProblemTask(9, 4, 0), Reward([fn]), 0.5)
        assert Reward([fn]).collective is not ahead
        out_of_process = type("Sampler", (), {"trainer_thread": False})()
        assert scores_ahead(task, out_of_process, None) is ahead
        assert task.score(["1"], [Problem("1+0=", "1")]) == [0.0]
    (tmp_path / "agent.py").write_text("def agent(client, problem):\n    return 0.0\n")
    cfg = load_config(
        GRPOExampleConfig,
        None,
        [
            f"task.agent.function={tmp_path / 'agent.py'}:agent",
            f"task.reward_model.path={tmp_path}",
        ],
    )
    with monkeypatch.context() as patch:
        patch.setattr("microrl.tasks.factory.reward_of", lambda *a, **k: Reward([Sharded()]))
        with pytest.raises(ValueError, match=r"task.reward_model under torchrun cannot score"):
            make_task(cfg.task)


def test_bad_engine_checkpoints_name_the_keys(trained_rm, rm_path, tmp_path) -> None:
    _, base, ckpt, _ = trained_rm
    with pytest.raises(ValueError, match=r"is an engine checkpoint .*set task.reward_model.base"):
        RewardModelScorer(str(ckpt))
    with pytest.raises(ValueError, match=r"task.reward_model.base='.*nowhere'.*not a local"):
        RewardModelScorer(str(ckpt), base=str(tmp_path / "nowhere"))
    # A base of another size: the checkpoint's tensors do not fit it (named, before loading).
    _, other, _ = train_reward_model_engine(tmp_path, hidden=16)
    with pytest.raises(ValueError, match=r"task.reward_model.base=.*does not match the model"):
        RewardModelScorer(str(ckpt), base=str(other))
    with pytest.raises(ValueError, match=r"task.reward_model.base must be unset without"):
        load_config(GRPOExampleConfig, None, [f"task.reward_model.base={base}"])
