"""A ``vllm serve`` process owned by the trainer: its process group dies with the trainer, its
errors carry the engine core's logged traceback (docs/async.md#vllm-servers)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from microrl.rollout import watcher
from microrl.rollout.samplers import vllm_options
from microrl.rollout.samplers.vllm_http import ServerClient, ServerError, exit_status

__all__ = ["LocalVLLMServer", "engine_traceback", "serve_command", "server_env"]


def serve_command(
    model_dir: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    weight_transfer: str | None = None,
    tensor_parallel_size: int = 1,
    engine_args: Mapping[str, Any] | None = None,
    **options: Any,
) -> list[str]:
    """The ``vllm serve`` arguments of a rollout server, no API key (``ps`` shows them);
    ``engine_args`` (checked by the caller) come last: argparse keeps the last of a flag."""
    args: dict[str, Any] = {"host": host, "port": port, "enable_scale_out": True}
    args.update(vllm_options.engine_args(model_dir, **options))
    for key in ("skip_tokenizer_init", "enforce_eager"):  # False: vLLM's default, no flag
        args[key] = args[key] or None
    if options.get("cpu"):
        # vLLM's CPU default adds a worker the engine core busy-waits for: a core burnt.
        args["distributed_executor_backend"] = "uni"
    if tensor_parallel_size > 1:
        args["tensor_parallel_size"] = tensor_parallel_size
    if weight_transfer:
        args.update(
            weight_transfer_config={"backend": weight_transfer}, enable_prefix_caching=False
        )
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    return command + vllm_options.cli_flags(args) + vllm_options.cli_flags(engine_args or {})


def server_env(
    api_key: str,
    *,
    full_weights: bool,
    num_threads: int,
    cpu: bool = False,
    cuda_visible_devices: str | None = None,
) -> dict[str, str]:
    """A local server's environment: this process's with the API key, without torchrun
    variables. ``cuda_visible_devices`` (physical ids): else a GPU server takes the first GPU."""
    env = dict(os.environ)
    env.update(
        VLLM_API_KEY=api_key,
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # never pin the trainer's cores
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
    )
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    for var in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        env.pop(var, None)
    if full_weights:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if num_threads:
        env["OMP_NUM_THREADS"] = str(num_threads)
    # CPU: the model in the engine core (serve_command); else vLLM's default, not the trainer's.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cpu else "1"
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


class LocalVLLMServer:
    """A ``vllm serve`` subprocess on localhost, answering when the constructor returns.

    Args:
        model_dir: the model to serve.
        full_weights: mount vLLM's RL routes (weight transfer, pause/resume).
        num_threads: its OpenMP threads on a CPU (0: vLLM's default).
        timeout_s: the longest wait for ``/health``.
        name: how errors and its log file name it.
        api_key: its ``--api-key``; None: a fresh random one.
        cuda_visible_devices: its GPUs (:func:`server_env`).
        log_dir: where ``<name>.log`` is appended to; None: a temporary file, kept on failure.
        options: :func:`serve_command`'s keyword arguments but ``port``.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        full_weights: bool,
        num_threads: int = 1,
        timeout_s: float = 600.0,
        name: str = "the local vLLM server",
        api_key: str | None = None,
        cuda_visible_devices: str | None = None,
        log_dir: str | os.PathLike | None = None,
        **options,
    ) -> None:
        self.name = name
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.port = vllm_options.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = server_env(
            self.api_key,
            full_weights=full_weights,
            num_threads=num_threads,
            cpu=options.get("cpu", False),
            cuda_visible_devices=cuda_visible_devices,
        )
        self.command = serve_command(model_dir, port=self.port, **options)
        self._log, self.log_path = _open_log(log_dir, name, self.command)
        self._keep_log = [log_dir is not None]
        self.process = subprocess.Popen(
            self.command,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: close() stops the engine core too
        )
        # Stopped with its group if this process dies before close() (SIGKILL included).
        watcher.watch("group", self.process.pid, label=name)
        self._finalizer = weakref.finalize(
            self, _stop, self.process, self._log, self.log_path, self._keep_log
        )
        self.client = ServerClient(
            self.url,
            self.api_key,
            timeout_s=timeout_s,
            explain=self.diagnosis,
            exit_code=self.exit_code,
        )
        try:
            self._wait_until_up(timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_until_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.client.healthy():
            if self.process.poll() is not None:
                raise ServerError(
                    f"{self.name} exited ({exit_status(self.process.returncode)}) while starting; "
                    f"{self.diagnosis()}"
                )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self.name} did not answer /health within {timeout_s:.0f} s "
                    f"(rollout.worker_timeout_s); {self.diagnosis()}"
                )
            time.sleep(0.5)

    def diagnosis(self) -> str:
        """What an error adds: the engine core's traceback, else the log's tail (log kept)."""
        self._keep_log[0] = True
        log = "(no log)"
        with contextlib.suppress(OSError):
            log = self.log_path.read_text(errors="replace")
            if trace := engine_traceback(log):
                return f"{self.name} failed with this traceback (log: {self.log_path}):\n{trace}"
            log = "\n".join(log.splitlines()[-30:])
        return f"{self.name}'s log ends ({self.log_path}):\n{log}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """Its exit code (``-N``: signal ``N``) within ``wait_s``; None while it runs."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout=wait_s)
        return None

    def close(self) -> None:
        """Stop its process group (SIGTERM, then SIGKILL); a temporary log goes unless it failed."""
        self._finalizer()


# A record's lines share one head: "(EngineCore pid=7) ERROR 12-03 17:54:19 [core.py:1512] ".
_TRACEBACK = "Traceback (most recent call last):"
_MAX_TRACEBACK_LINES = 40


def engine_traceback(log: str) -> str | None:
    """The last traceback in a ``vllm serve`` log, without line heads: the engine core's (the
    cause of an ``HTTP 500``), else the last at ``ERROR`` or printed bare; None without one."""
    lines = log.splitlines()
    starts = []
    for i, line in enumerate(lines):
        head, found, _ = line.partition(_TRACEBACK)
        if found and (not head.strip() or " ERROR " in head):
            starts.append((i, head))
    if not starts:
        return None
    start, head = max(starts, key=lambda s: ("EngineCore" in s[1], s[0]))  # EngineCore's last
    trace = [_TRACEBACK]
    for line in lines[start + 1 :]:
        if head.strip():  # a logged record: its lines share the head
            if not line.startswith(head):
                break
            trace.append(line[len(head) :])
        else:  # printed bare: frames are indented, the exception line ends it
            trace.append(line)
            if line and not line[0].isspace():
                break
    if len(trace) > _MAX_TRACEBACK_LINES:
        trace = [trace[0], "  ...", *trace[-(_MAX_TRACEBACK_LINES - 2) :]]
    return "\n".join(trace)


def _open_log(log_dir, name: str, command: list[str]):
    """The server's log, open to append, and its path: ``<log_dir>/<name>.log`` or a temp file."""
    if log_dir is None:
        log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the server)
            prefix="microrl-vllm-serve-", suffix=".log", delete=False
        )
        return log, Path(log.name)
    path = Path(log_dir) / (re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() + ".log")
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("ab")
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    log.write(f"=== microrl: {name} started {started}: {' '.join(command)}\n".encode())
    log.flush()
    return log, path


def _stop(process: subprocess.Popen, log, log_path: Path, keep_log: list[bool]) -> None:
    if process.poll() is not None:  # it died before it was stopped: a failure
        keep_log[0] = True
    else:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait)
                break
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # an engine core left behind by its parent
    watcher.release("group", process.pid)
    with contextlib.suppress(OSError):
        log.close()
        if not keep_log[0]:
            log_path.unlink()
