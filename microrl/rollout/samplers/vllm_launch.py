"""A ``vllm serve`` process started and owned by the trainer (docs/async.md#vllm-servers).

:class:`LocalVLLMServer` runs vLLM's own OpenAI-compatible server (``AsyncLLM`` behind it) on
``127.0.0.1`` with a fresh random API key, for the asynchronous ``vllm`` backend when no
``rollout.server.url`` is given. The command is the one the docs give users who start servers
themselves, so both modes exercise the same server. It is never reachable from another machine,
and it is stopped (its whole process group: the API server and its engine-core process) when
the trainer closes it or exits, or by the trainer's watcher when the trainer is killed
(:mod:`~microrl.rollout.watcher`). Its log is kept under the run's ``log_dir`` (or in a
temporary file kept only when it failed), and an error about it carries the traceback its
engine core logged (:func:`engine_traceback`): vLLM's own HTTP answer names no cause; a server
that died mid-request is reported dead, with its exit code and its log.
"""

from __future__ import annotations

import contextlib
import json
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
from microrl.rollout.samplers.vllm_http import ServerClient, ServerError, exit_status
from microrl.rollout.samplers.vllm_options import cli_flags, cpu_scheduler_args, free_port

__all__ = ["LocalVLLMServer", "engine_traceback", "serve_command", "server_env"]


def serve_command(
    model_dir: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int = 0,
    kv_cache_mb: int = 0,
    gpu_memory_utilization: float = 0.3,
    enforce_eager: bool = False,
    seed: int = 0,
    lora_rank: int = 0,
    max_loras: int = 1,
    weight_transfer: str | None = None,
    cpu: bool = False,
    tensor_parallel_size: int = 1,
    engine_args: Mapping[str, Any] | None = None,
    images: bool = False,
) -> list[str]:
    """The ``vllm serve`` arguments of a rollout server (without the API key, which travels in
    the ``VLLM_API_KEY`` environment variable, not on a command line ``ps`` shows).

    ``--skip-tokenizer-init`` and ``--enable-scale-out``: the trainer sends token ids and reads
    token ids (``/inference/v1/generate``); ``--logprobs-mode processed_logprobs``: the sampled
    tokens' log-probs at the sampling temperature, the distribution the loss scores. LoRA
    (``lora_rank > 0``) enables runtime adapter loading; full weights (``weight_transfer``)
    enable vLLM's weight-transfer engine of that backend, and prefix caching is off then: a
    cached block computed with old weights must not serve a request of the new ones.
    ``tensor_parallel_size > 1`` splits the model over that many GPUs (those of the server's
    ``CUDA_VISIBLE_DEVICES``, :func:`server_env`). On a CPU, no chunked prefill
    (:func:`~microrl.rollout.samplers.vllm_options.cpu_scheduler_args`).
    ``engine_args`` (``rollout.vllm.engine_kwargs``, checked by the caller) come last as flags:
    where one sets what a default above set, argparse keeps the last.
    ``images``: a vision-language policy's servers: they load the tokenizer and the image
    processor saved beside the weights (no ``--skip-tokenizer-init``: vLLM's multimodal
    processor needs them) and take no video (``--limit-mm-per-prompt``).
    """
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        *([] if images else ["--skip-tokenizer-init"]),
        "--enable-scale-out",
        "--dtype",
        dtype,
        "--seed",
        str(seed),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
    ]
    if cpu:
        # The model runs in the engine-core process (with server_env's
        # VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM's default on a CPU adds a worker process the
        # engine core busy-waits for, a second core burnt (1.0 against 0.65 CPU-s per job).
        command += ["--distributed-executor-backend", "uni"]
        command += cli_flags(cpu_scheduler_args())
    if images:  # images only: no video processor is profiled
        command += ["--limit-mm-per-prompt", json.dumps({"video": 0})]
    if tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if enforce_eager:
        command.append("--enforce-eager")
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if kv_cache_mb:
        command += ["--kv-cache-memory-bytes", str(kv_cache_mb * 1024 * 1024)]
    if lora_rank:
        command += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
        command += ["--max-loras", str(max_loras)]
    if weight_transfer:
        command += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
        command.append("--no-enable-prefix-caching")
    return command + cli_flags(engine_args or {})


def server_env(
    api_key: str,
    *,
    full_weights: bool,
    num_threads: int,
    cpu: bool = False,
    cuda_visible_devices: str | None = None,
) -> dict[str, str]:
    """The environment of a local server: this process's, with the API key (never on the
    command line), unpinned CPU threads, runtime LoRA loading, and vLLM's RL routes
    (``VLLM_SERVER_DEV_MODE``) only for full weights; never vLLM's insecure pickle
    serialization, and none of torchrun's variables (the server is no rank of the trainer's
    group). ``cuda_visible_devices`` (physical ids,
    :func:`~microrl.rollout.samplers.vllm_placement.cuda_visible_devices`) are the server's GPUs:
    without it a GPU server would start on the first GPU it sees, whichever rank started it."""
    env = dict(os.environ)
    env.update(
        VLLM_API_KEY=api_key,
        VLLM_CPU_OMP_THREADS_BIND="nobind",  # never pin the trainer's cores
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
    )
    if full_weights:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        env.pop("VLLM_SERVER_DEV_MODE", None)
    if num_threads:
        env["OMP_NUM_THREADS"] = str(num_threads)
    # CPU: the model in the engine-core process (serve_command's cpu); else vLLM's default, not
    # the trainer's "0" (set in this process by the colocated vllm backend).
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cpu else "1"
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    return env


class LocalVLLMServer:
    """A ``vllm serve`` subprocess on localhost, up and answering when the constructor returns.

    Args:
        model_dir: the model to serve (the trainer's base model, exported).
        full_weights: also mount vLLM's RL routes (``VLLM_SERVER_DEV_MODE=1``: weight transfer,
            pause/resume); LoRA-only servers need none of them.
        num_threads: the server's OpenMP threads on a CPU (0: vLLM's default).
        timeout_s: the longest wait for it to answer ``/health``.
        name: how errors name it, and its log file's name.
        api_key: its ``--api-key``; None: a fresh random one.
        cuda_visible_devices: its GPUs (:func:`server_env`); None: this process's (a CPU).
        log_dir: where its log is written (``<log_dir>/<name>.log``, appended to, kept); None:
            a temporary file, removed at :meth:`close` unless the server failed.
        options: :func:`serve_command`'s keyword arguments but ``port`` (a free one is chosen).
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
        self.port = free_port()
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
        # Whether close() keeps the log: always in log_dir; a temporary one once the server failed.
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

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def diagnosis(self) -> str:
        """What an error about this server adds: the engine core's own traceback from its log
        (:func:`engine_traceback`), else the log's last lines; the log is kept from now on."""
        self._keep_log[0] = True
        with contextlib.suppress(OSError):
            trace = engine_traceback(self.log_path.read_text(errors="replace"))
            if trace:
                return f"{self.name} failed with this traceback (log: {self.log_path}):\n{trace}"
        return f"{self.name}'s log ends ({self.log_path}):\n{self.log_tail()}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """The server's exit code once it exited (``-N``: killed by signal ``N``), waiting at
        most ``wait_s`` for it; None while it runs."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(timeout=wait_s)
        return None

    def close(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL); remove its log if it is a
        temporary one and the server did not fail."""
        self._finalizer()


# A line vLLM logs: "(EngineCore pid=7) ERROR 12-03 17:54:19 [core.py:1512] <text>"; the head
# before <text> is the same on every line of one record (one traceback).
_TRACEBACK = "Traceback (most recent call last):"
_MAX_TRACEBACK_LINES = 40


def engine_traceback(log: str) -> str | None:
    """The last error traceback in a ``vllm serve`` log, without vLLM's line heads: the engine
    core's when it logged one (a server answering ``HTTP 500 EngineCore encountered an issue``
    logged the cause there), else the last one logged at ``ERROR`` or printed bare (a crash at
    start-up); None without one. Long tracebacks keep their first line and last lines."""
    lines = log.splitlines()
    starts = []
    for i, line in enumerate(lines):
        head, found, _ = line.partition(_TRACEBACK)
        if found and (not head.strip() or " ERROR " in head):
            starts.append((i, head))
    if not starts:
        return None
    engine = [(i, head) for i, head in starts if "EngineCore" in head]
    start, head = (engine or starts)[-1]
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
    """The server's log file, open for appending, and its path: ``<log_dir>/<name>.log`` (a
    resumed run's server appends to its predecessor's), or a temporary file."""
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
