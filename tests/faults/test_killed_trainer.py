"""A trainer SIGKILLed (the OOM killer, ``kill -9``) leaves no server, engine core or model
directory behind (microrl/rollout/watcher.py, docs/async.md#when-the-trainer-dies).

The trainer is a process of its own that starts a stand-in for ``vllm serve`` through
``LocalVLLMServer`` (the launch path of the rollout and teacher servers) with a child standing
in for vLLM's engine core, and makes its model directory as ``VLLMServerRollout`` does.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

# `vllm serve` in miniature: /health answers, and a child in its process group.
SERVER = r"""
import http.server, subprocess, sys

port, core_pid_file = int(sys.argv[1]), sys.argv[2]
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(core_pid_file, "w") as f:
    f.write(str(core.pid))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""

TRAINER = r"""
import json, sys, time

from microrl.rollout.samplers import vllm_options
from microrl.rollout.samplers import vllm_launch
from microrl.rollout.weights.server_syncs import WORKDIR_PREFIX

server, core_pid_file = sys.argv[1], sys.argv[2]
vllm_launch.serve_command = lambda model_dir, *, port, **options: [
    sys.executable, server, str(port), core_pid_file
]
workdir, _ = vllm_options.make_workdir(None, WORKDIR_PREFIX)
(workdir / "base").mkdir()
(workdir / "base" / "model.safetensors").write_bytes(bytes(1 << 20))
started = vllm_launch.LocalVLLMServer(
    str(workdir / "base"), full_weights=False, timeout_s=120, name="local vLLM server 0 of rank 0"
)
print(json.dumps({"server": started.process.pid, "workdir": str(workdir)}), flush=True)
time.sleep(600)
"""


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is no zombie (dead, waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:  # gone, or no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return not os.path.isdir("/proc")


START_S = 240  # importing microrl and starting the stand-in on a loaded 2-core machine
GONE_S = 20  # the watcher's SIGTERM ends the stand-ins at once


def _first_line(process: subprocess.Popen, timeout_s: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            raise AssertionError(f"the trainer printed nothing within {timeout_s} s")
    return process.stdout.readline()


def test_a_killed_trainers_server_engine_core_and_model_directory_are_gone(tmp_path):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "server.py").write_text(SERVER)
    core_pid_file = tmp_path / "core.pid"
    stderr = (tmp_path / "trainer.err").open("w")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path / "server.py"), str(core_pid_file)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )
    pids, workdir = [], None
    try:
        line = _first_line(trainer, START_S)
        assert line, f"the trainer failed: {(tmp_path / 'trainer.err').read_text()[-3000:]}"
        started = json.loads(line)
        pids = [started["server"], int(core_pid_file.read_text())]
        workdir = started["workdir"]
        assert all(_process_alive(pid) for pid in pids) and os.path.isdir(workdir)

        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + GONE_S
        while time.monotonic() < deadline and (
            any(_process_alive(pid) for pid in pids) or os.path.exists(workdir)
        ):
            time.sleep(0.1)
        running = [pid for pid in pids if _process_alive(pid)]
        assert not running, f"the server ({pids[0]}) or its engine core ({pids[1]}) outlived it"
        assert not os.path.exists(workdir), f"{workdir} outlived the trainer"
        said = (tmp_path / "trainer.err").read_text()
        assert "stopped local vLLM server 0 of rank 0" in said and f"removed {workdir}" in said
    finally:
        trainer.kill()
        trainer.wait()
        stderr.close()
        for pid in pids:  # stragglers of a failed run
            if _process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
