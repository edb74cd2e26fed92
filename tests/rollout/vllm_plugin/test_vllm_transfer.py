"""microrl.rollout.vllm_plugin.transfer: weights pushed into a real ``vllm serve`` over vLLM's
weight-transfer API with the ``"gloo"`` engine (vLLM on the CPU), and the pusher's checks.

One server per module (a toy Llama, ~20-40 s to start on a 2-core CPU); every server test starts
its own ``WeightPusher`` (a fresh transfer group, which the server's engine re-creates) and first
pushes a full model, so the tests do not depend on their order.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from microrl.rollout.weights.pusher import WeightPusher

# vLLM's CPU kernels and the transformers float32 forward round differently (attention, GEMM
# blocking, vLLM's packed GEMM weights): measured |Δ| <= 2.4e-7 on these log-probs of size ~3;
# 1e-4 leaves room for other CPUs and is still far below the >= 1e-2 by which the models pushed
# here differ (asserted in each test, so a push that loaded nothing could not pass).
LOGPROB_ATOL = 1e-4
PROMPTS = ["12+7=19", "35+7=42", "9+99=108"]
TIMEOUT_S = 60.0  # the pusher's: every wait on the server or the group


def _model(tokenizer, seed: int):
    from microrl.configs.run import ModelConfig
    from microrl.run.toy_model import build_model

    # head_dim 32: the smallest head size vLLM's CPU attention supports.
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, seed=seed)
    return build_model(cfg, tokenizer).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from microrl.run.toy_model import build_tokenizer

    return build_tokenizer()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """End the server and its engine-core and worker children (its own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # children that outlived the API server
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    """The base URL of ``vllm serve`` for the seed-0 toy model, with the gloo transfer engine."""
    workdir = tmp_path_factory.mktemp("vllm-serve")
    _model(tokenizer, seed=0).save_pretrained(workdir / "model")
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(workdir / "model"), "--skip-tokenizer-init", "--enable-scale-out",
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32",
        "--kv-cache-memory-bytes", str(256 * 2**20), "--max-model-len", "32",
        "--weight-transfer-config", '{"backend":"gloo"}',
    ]  # fmt: skip
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after 300 s:\n{_tail(log_path)}")
            time.sleep(1)
        yield base
    finally:
        _stop(proc)


def _tail(path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _poster(base: str):
    """The ``post(route, json_body)`` the pusher takes: raises with the route and the server's
    message on an HTTP error."""

    def post(route: str, body: dict | None):
        data = b"" if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            base + route, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"POST {route}: HTTP {err.code}: {err.read().decode()}") from None

    return post


def _token_ids(tokenizer) -> list[list[int]]:
    return [
        [tokenizer.bos_token_id, *tokenizer(p, add_special_tokens=False)["input_ids"]]
        for p in PROMPTS
    ]


def _server_logprobs(base: str, tokenizer) -> tuple[torch.Tensor, set[str]]:
    """The server's prompt log-probs of every prompt token after the first, and the weight
    versions its answers report."""
    post = _poster(base)
    logprobs, versions = [], set()
    for ids in _token_ids(tokenizer):
        sampling = {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}
        out = post("/inference/v1/generate", {"token_ids": ids, "sampling_params": sampling})
        for i, entry in enumerate(out["prompt_logprobs"][1:], start=1):
            logprobs.append(entry[str(ids[i])]["logprob"])
        versions |= {span["version"] for span in out["choices"][0]["weight_versions"]}
    return torch.tensor(logprobs), versions


def _reference_logprobs(model, tokenizer) -> torch.Tensor:
    """The same log-probs from a transformers float32 forward."""
    out = []
    with torch.no_grad():
        for ids in _token_ids(tokenizer):
            logits = model(torch.tensor([ids])).logits.float()
            logprobs = torch.log_softmax(logits, dim=-1)[0]
            out += [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    return torch.tensor(out)


def _weight_version(base: str) -> str:
    with urllib.request.urlopen(f"{base}/weight_info", timeout=TIMEOUT_S) as response:
        return json.loads(response.read())["weight_version"]


def _state(model) -> list[tuple[str, torch.Tensor]]:
    # state_dict, not named_parameters: the tied lm_head.weight must travel too (vllm_transfer's
    # docstring: vLLM's CPU build refreshes its packed LM head only on a load of that name).
    return list(model.state_dict().items())


def _assert_holds(base, tokenizer, model, version: str) -> torch.Tensor:
    served, versions = _server_logprobs(base, tokenizer)
    reference = _reference_logprobs(model, tokenizer)
    assert (served - reference).abs().max().item() <= LOGPROB_ATOL
    assert versions == {version}
    assert _weight_version(base) == version
    return served


@pytest.mark.slow
def test_pushed_weights_are_served_with_their_version(server, tokenizer):
    served_before, _ = _server_logprobs(server, tokenizer)
    first, second = _model(tokenizer, seed=1), _model(tokenizer, seed=2)
    with WeightPusher("gloo", _poster(server), timeout_s=TIMEOUT_S) as pusher:
        pusher.push(_state(first), version=1)
        served = _assert_holds(server, tokenizer, first, "1")
        assert (served - served_before).abs().max().item() > 1e-2
        pusher.push(_state(second), version=2)  # a second round on the same group
        served_second = _assert_holds(server, tokenizer, second, "2")
        assert (served_second - served).abs().max().item() > 1e-2
        assert pusher.version == 2


@pytest.mark.slow
def test_a_tensor_left_out_keeps_its_old_value(server, tokenizer):
    """A push without one tensor serves the old value of that tensor: the probe sees it."""
    old, new = _model(tokenizer, seed=3), _model(tokenizer, seed=4)
    # A layer of its own in vLLM (not fused with another checkpoint tensor like q/k/v): left
    # out, the layer keeps its old weights rather than being half-loaded.
    stale = "model.layers.1.mlp.down_proj.weight"
    with WeightPusher("gloo", _poster(server), timeout_s=TIMEOUT_S) as pusher:
        pusher.push(_state(old), version=3)
        _assert_holds(server, tokenizer, old, "3")
        pusher.push([(n, t) for n, t in _state(new) if n != stale], version=4)
    hybrid = _model(tokenizer, seed=4)
    hybrid.load_state_dict({**new.state_dict(), stale: old.state_dict()[stale]})
    served = _assert_holds(server, tokenizer, hybrid, "4")
    assert (served - _reference_logprobs(new, tokenizer)).abs().max().item() > 1e-2


@pytest.mark.slow
def test_a_name_the_server_rejects_is_reported_and_a_full_push_repairs(server, tokenizer):
    model, other = _model(tokenizer, seed=5), _model(tokenizer, seed=6)
    with WeightPusher("gloo", _poster(server), timeout_s=TIMEOUT_S) as pusher:
        pusher.push(_state(model), version=5)
        bad = [("model.no_such_layer.weight", torch.zeros(4)), *_state(other)]
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"/update_weights.*no_such_layer"):
            pusher.push(bad, version=6)
        assert time.monotonic() - started < TIMEOUT_S / 2  # reported, not timed out
        # Rejected first, so nothing loaded; the version did not move.
        _assert_holds(server, tokenizer, model, "5")
        pusher.push(_state(other), version=7)  # the group is still in step
        _assert_holds(server, tokenizer, other, "7")


# ----------------------------------------------------------------------------- no server
def test_backend_and_arguments_are_validated():
    def post(route, body):
        raise AssertionError("no call expected")

    with pytest.raises(ValueError, match="'tcp'"):
        WeightPusher("tcp", post)
    with pytest.raises(ValueError, match="world_size"):
        WeightPusher("gloo", post, world_size=1)
    with pytest.raises(ValueError, match="timeout_s"):
        WeightPusher("gloo", post, timeout_s=0)
    with pytest.raises(TypeError, match="post"):
        WeightPusher("gloo", None)
    with pytest.raises(RuntimeError, match="start"):
        WeightPusher("gloo", post).push([("w", torch.zeros(1))], version=1)


def test_nccl_needs_cuda_and_says_so(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pusher = WeightPusher("nccl", lambda route, body: calls.append(route))
    with pytest.raises(RuntimeError, match=r"CUDA.*gloo"):
        pusher.start()
    assert calls == []  # refused before the server was asked for anything


def test_nccl_goes_through_vllm_trainer_engine(monkeypatch):
    """The nccl branch is vLLM's own: its trainer init info, routed by vLLM's trainer factory to
    its NCCLTrainerWeightTransferEngine (stubbed here: no CUDA); CPU tensors are refused."""
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    seen = {}

    def trainer_init(cls, init_info, *, client, source=None):
        seen.update(cls=cls, init_info=init_info, client=client, source=source)
        return object()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(NCCLTrainerWeightTransferEngine, "trainer_init", classmethod(trainer_init))
    posts = []
    pusher = WeightPusher("nccl", lambda route, body: posts.append((route, body)), world_size=3)
    pusher.start()
    assert seen["cls"] is NCCLTrainerWeightTransferEngine
    info = seen["init_info"]
    assert isinstance(info, NCCLTrainerInitInfo)
    assert (info.rank, info.world_size, info.master_address) == (0, 3, "127.0.0.1")
    assert 0 < info.master_port < 65536
    assert isinstance(seen["client"], VLLMWeightSyncClient)
    with pytest.raises(ValueError, match=r"'w' is on cpu.*nccl"):
        pusher.push([("w", torch.zeros(2))], version=1)
    # vLLM's engine finishes with client.finish_weight_update(): the version rides the client.
    seen["client"].version = "7"
    seen["client"].finish_weight_update()
    assert posts == [("/finish_weight_update", {"weight_version": "7"})]


def test_push_input_is_checked(monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    monkeypatch.setattr(
        WeightTransferTrainerFactory, "trainer_init", classmethod(lambda cls, *a, **k: object())
    )
    pusher = WeightPusher("gloo", lambda route, body: None)
    pusher.start()
    with pytest.raises(ValueError, match=r"'w' is on meta.*gloo"):
        pusher.push([("w", torch.empty(2, device="meta"))], version=1)
    with pytest.raises(ValueError, match="twice"):
        pusher.push([("w", torch.zeros(1)), ("w", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="no weights"):
        pusher.push([], version=1)
    with pytest.raises(TypeError, match="not a tensor"):
        pusher.push([("w", [1.0])], version=1)
    with pytest.raises(TypeError, match="version"):
        pusher.push([("w", torch.zeros(1))], version="1")


def test_a_failing_server_call_is_raised_at_once_and_a_silent_one_times_out():
    """The trainer's half of a collective waits on the server's; neither may hang the push."""
    import threading

    from microrl.rollout.vllm_plugin.transfer import _together

    never = threading.Event()

    def fail():
        raise RuntimeError("POST /update_weights: HTTP 500: boom")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="boom") as info:
        _together(fail, never.wait, route="/update_weights", timeout_s=30)
    assert time.monotonic() - started < 5
    assert info.value.local_done is False  # the group is out of step
    with pytest.raises(TimeoutError, match=r"/update_weights.*server"):
        _together(never.wait, lambda: None, route="/update_weights", timeout_s=0.2)
    assert _together(lambda: None, lambda: 3, route="/x", timeout_s=5) == 3


def test_the_plugin_registers_gloo_idempotently_and_is_an_entry_point(monkeypatch):
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from microrl.rollout.vllm_plugin import transfer

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert (
        plugins["microrl_gloo_weight_transfer"] == "microrl.rollout.vllm_plugin.transfer:register"
    )
    transfer.register()
    transfer.register()  # vLLM may load plugins more than once
    assert "gloo" in WeightTransferEngineFactory._registry
    engine_cls = WeightTransferEngineFactory._registry["gloo"]()
    assert engine_cls is transfer.GlooWeightTransferEngine
    assert issubclass(engine_cls, NCCLWeightTransferEngine)  # vLLM's lifecycle, another wire
    # Without vLLM the plugin is a no-op, and importing the module never needs it.
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", None)
    transfer.register()
    code = (
        "import sys; import microrl.rollout.vllm_plugin.transfer as t\n"
        "assert 'vllm' not in sys.modules, 'imported vllm'\n"
        "sys.modules['vllm'] = None; t.register()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
