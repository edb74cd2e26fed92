"""A server that dies during a request is reported dead, with its exit code and its log, never as
a timeout that did not happen; a request that did wait ``timeout_s`` says so
(microrl/rollout/samplers/vllm_http.py, docs/async.md#when-the-trainer-dies)."""

from __future__ import annotations

import http.server
import sys
import threading
import time

import pytest

from microrl.rollout.samplers import vllm_launch
from microrl.rollout.samplers.vllm_http import ServerClient, ServerError

# A stand-in for `vllm serve` that dies while it serves a request, as one killed by the OOM
# killer or by its engine core's crash does.
DYING_SERVER = r"""
import http.server, os, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        print("RuntimeError: CUDA error: an illegal memory access was encountered", flush=True)
        os._exit(3)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_server_that_dies_mid_request_is_reported_dead_with_its_exit_code_and_log(
    tmp_path, monkeypatch
):
    script = tmp_path / "dying_server.py"
    script.write_text(DYING_SERVER)
    command = lambda model_dir, *, port, **options: [sys.executable, str(script), str(port)]  # noqa: E731
    monkeypatch.setattr(vllm_launch, "serve_command", command)
    server = vllm_launch.LocalVLLMServer(
        "/model", full_weights=False, name="local vLLM server 0 of rank 0", timeout_s=600
    )
    try:
        start = time.monotonic()
        with pytest.raises(ServerError) as failed:
            server.client.post("inference/v1/generate", {"token_ids": [1, 2]})
        assert time.monotonic() - start < 30
        message = str(failed.value)
        assert "died (exit code 3) during POST /inference/v1/generate" in message
        assert str(server.log_path) in message and "illegal memory access" in message
        assert "timeout" not in message and "600 s" not in message
    finally:
        server.close()
        server.log_path.unlink(missing_ok=True)


class _Stalling(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        time.sleep(3)

    def log_message(self, *args) -> None:
        pass


class _Hanging(_Stalling):
    def do_POST(self):  # closes the connection without an answer
        self.close_connection = True


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (_Stalling, r"did not answer POST /inference/v1/generate within 1 s"),
        (_Hanging, r"the connection failed \(RemoteDisconnected: Remote end closed"),
    ],
    ids=["timed-out", "closed-unanswered"],
)
def test_a_request_says_it_timed_out_only_when_it_did(handler, expected):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = ServerClient(f"http://127.0.0.1:{httpd.server_address[1]}", "key", timeout_s=1)
        with pytest.raises(ServerError, match=expected) as failed:
            client.post("inference/v1/generate", {})
        if handler is _Hanging:
            assert "within" not in str(failed.value) and "timeout" not in str(failed.value)
    finally:
        httpd.shutdown()
        httpd.server_close()
