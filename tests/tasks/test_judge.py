"""An LLM judge as a reward term (microrl/tasks/judge.py), against a stand-in OpenAI-compatible
server in this process: scores parsed from replies, the concurrency bound, the per-request
timeout, retries with backoff, the cache per (prompt, response), unparsable replies and failed
requests (an error naming the row, or the fallback counted in judge/failures), the key from the
environment (a wrong one is not retried, and the key shows in no message), the config's errors.
"""

from __future__ import annotations

import re
import time

import pytest
from model_reward_utils import JUDGE_KEY, JudgeScript, judge_server

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.judge import JudgeConfig
from microrl.configs.loader import load_config
from microrl.tasks.judge import JudgeError, JudgeReward, parse_score

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
RESPONSES = ["2", "44", "666", "8888"]
ANSWERS = ["2", "4", "6", "8"]


def _reply_length(content: str) -> str:
    """The grade the stand-in gives: 'Score: <length of the response>'."""
    response = content.split("R:", 1)[1]
    return f"Score: {len(response)}"


def _judge(url: str, monkeypatch, **overrides) -> JudgeReward:
    monkeypatch.setenv("MY_JUDGE_KEY", JUDGE_KEY)
    fields = dict(
        url=url,
        model="judge",
        template="P:{prompt} A:{answer} R:{response}",
        score_pattern=r"Score: (\d+)",
        api_key_env="MY_JUDGE_KEY",
        timeout_s=5.0,
        backoff_s=0.01,
    )
    return JudgeReward(JudgeConfig(**{**fields, **overrides}))


def test_scores_concurrency_bound_and_cache(monkeypatch) -> None:
    script = JudgeScript(reply=_reply_length, delay_s=0.15)
    with judge_server(script) as url:
        judge = _judge(url, monkeypatch, max_concurrency=2)
        rows = [*RESPONSES, RESPONSES[0]]  # a repeated row is asked once, a cache hit
        t0 = time.perf_counter()
        assert judge(rows, [*PROMPTS, PROMPTS[0]], [*ANSWERS, ANSWERS[0]]) == [1, 2, 3, 4, 1]
        elapsed = time.perf_counter() - t0
        assert len(script.requests) == 4 and script.max_in_flight == 2
        assert elapsed >= 2 * 0.15  # 4 requests, 2 at a time: at least two rounds
        first = next(r for r in script.requests if "R:2" in r["messages"][0]["content"])
        assert first["messages"] == [{"role": "user", "content": "P:1+1= A:2 R:2"}]
        assert first["max_tokens"] == 16 and first["temperature"] == 0
        assert set(script.auth) == {f"Bearer {JUDGE_KEY}"}  # from the named variable
        # Asked again (the held-out set at every evaluation): from the cache, no request.
        assert judge(RESPONSES[:2], PROMPTS[:2], ANSWERS[:2]) == [1, 2]
        assert len(script.requests) == 4
    metrics = judge.drain_metrics()
    assert metrics == {
        "judge/requests": 4.0,
        "judge/retries": 0.0,
        "judge/cache_hits": 1.0 + 2.0,  # the repeat within the first call, then the two
        "judge/failures": 0.0,
    }


def test_the_bound_holds_across_concurrent_calls(monkeypatch) -> None:
    """A rollout scored in the background while the held-out set is: still max_concurrency."""
    from concurrent.futures import ThreadPoolExecutor

    script = JudgeScript(reply=_reply_length, delay_s=0.1)
    with judge_server(script) as url:
        judge = _judge(url, monkeypatch, max_concurrency=2)
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(judge, [r + x for r in RESPONSES], PROMPTS, ANSWERS) for x in "ab"]
            assert [c.result() for c in calls] == [[2, 3, 4, 5]] * 2
    assert len(script.requests) == 8 and script.max_in_flight == 2


def test_retries_with_backoff_then_gives_up_naming_the_row(monkeypatch) -> None:
    script = JudgeScript(reply=_reply_length, fail=503, fail_times=2)
    with judge_server(script) as url:
        judge = _judge(url, monkeypatch, retries=2, backoff_s=0.05)
        t0 = time.perf_counter()
        assert judge(RESPONSES[:1], PROMPTS[:1], ANSWERS[:1]) == [1]
        assert time.perf_counter() - t0 >= 0.05 + 0.1  # waited backoff_s, then twice that
        assert judge.drain_metrics()["judge/retries"] == 2 and len(script.requests) == 3
        script.fail_times = 5
        judge = _judge(url, monkeypatch, retries=1)
        with pytest.raises(JudgeError, match=r"could not score row 0 .* after 2 attempts: .*503"):
            judge(RESPONSES[1:2], PROMPTS[1:2], ANSWERS[1:2])


def test_a_request_past_its_timeout_is_retried_then_counted(monkeypatch) -> None:
    script = JudgeScript(reply=_reply_length, delay_s=1.0)
    with judge_server(script) as url:
        judge = _judge(url, monkeypatch, timeout_s=0.2, retries=1, failure_score=-1.0)
        t0 = time.perf_counter()
        assert judge(RESPONSES[:2], PROMPTS[:2], ANSWERS[:2]) == [-1.0, -1.0]
        assert time.perf_counter() - t0 < 1.5  # never waited the server's full second twice
        metrics = judge.drain_metrics()
        assert metrics["judge/failures"] == 2 and metrics["judge/retries"] == 2
        # A failure is not cached: the rows are asked again next time.
        script.delay_s = 0.0
        assert judge(RESPONSES[:2], PROMPTS[:2], ANSWERS[:2]) == [1, 2]


def test_unparsable_replies_are_an_error_or_the_counted_fallback(monkeypatch) -> None:
    script = JudgeScript(reply=lambda content: "great!" if "R:44" in content else "Score: 3")
    with judge_server(script) as url:
        judge = _judge(url, monkeypatch)
        with pytest.raises(
            JudgeError, match=r"row 1 \(prompt '2\+2=', response '44'\): no score .* 'great!'"
        ):
            judge(RESPONSES, PROMPTS, ANSWERS)
        judge = _judge(url, monkeypatch, failure_score=0.0)
        assert judge(RESPONSES, PROMPTS, ANSWERS) == [3, 0.0, 3, 3]
        assert judge.drain_metrics()["judge/failures"] == 1


def test_a_wrong_key_fails_at_once_and_no_message_shows_the_key(monkeypatch, caplog) -> None:
    script = JudgeScript(reply=_reply_length, key="the-right-key")
    with judge_server(script) as url:
        judge = _judge(url, monkeypatch, retries=3)
        with pytest.raises(JudgeError) as raised:
            judge(RESPONSES[:1], PROMPTS[:1], ANSWERS[:1])
    assert len(script.requests) == 1  # a 401 is not retried
    message = str(raised.value)
    assert "401" in message and "task.judge.api_key_env" in message
    assert JUDGE_KEY not in message + caplog.text + repr(judge) + repr(judge.config)


def test_no_key_in_the_environment_sends_none(monkeypatch) -> None:
    """As the docs say: no Authorization header at all (not the client's placeholder)."""
    script = JudgeScript(reply=_reply_length, key=None)
    with judge_server(script) as url:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        judge = JudgeReward(JudgeConfig(url=url, model="judge", template="R:{response}"))
        assert judge(["abc", "de"], ["p", "q"], ["a", "b"]) == [3.0, 2.0]
    assert script.auth == [None, None]


def test_parse_score() -> None:
    plain, grouped = re.compile(r"-?\d+(?:\.\d+)?"), re.compile(r"grade=(\d+)")
    assert parse_score("I'd say 7.5/10", plain) == 7.5
    assert parse_score("grade=4 (of 9)", grouped) == 4.0
    assert parse_score("none", plain) is None and parse_score("", grouped) is None
    assert parse_score("nan", re.compile(r"nan")) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.judge.url=localhost:8000"], "task.judge.url must be an http:// or https:// URL"),
        (["task.judge.url=http://h/v1"], "task.judge.model must be the model name"),
        (
            ["task.judge.url=http://h/v1", "task.judge.model=m", "task.judge.template='{grade}'"],
            r"task.judge.template must use only the fields",
        ),
        (
            ["task.judge.url=http://h/v1", "task.judge.model=m", "task.judge.score_pattern='('"],
            "task.judge.score_pattern is not a regex",
        ),
        (
            ["task.judge.url=http://h/v1", "task.judge.model=m", "task.judge.max_concurrency=0"],
            "task.judge.max_concurrency must be >= 1",
        ),
        (
            [
                "task.judge.url=http://h/v1",
                "task.judge.model=m",
                f"task.judge.api_key_env={JUDGE_KEY}-x",
            ],
            "task.judge.api_key_env must name an environment variable",
        ),
        (
            ["task.name=hinted_addition", "task.judge.url=http://h/v1", "task.judge.model=m"],
            "task.judge.url must be empty with task.name=hinted_addition",
        ),
        (
            ["task.judge.url=http://h/v1", "task.judge.model=m", "task.rewards.weights=[1.0,2.0]"],
            r"one weight per reward term \(1: task.judge\)",
        ),
    ],
)
def test_bad_judge_config_names_the_key(overrides, message) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        load_config(GRPOExampleConfig, None, ["task.max_operand=9", "task.eval_size=8", *overrides])
    assert JUDGE_KEY not in str(raised.value)
