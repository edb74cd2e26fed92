"""Model-based rewards for tests: a tiny sequence-classification reward model saved with the toy
tokenizer, a ``RewardModelEngine`` trained one LoRA step and saved as an engine checkpoint, and a
stand-in OpenAI-compatible judge server (standard library HTTP, in the test
process) whose replies, delays, failures and key check a test scripts."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from microrl.run.toy_model import build_tokenizer

# Four rows of two pairs (toy-tokenizer text): what the trained reward model sees.
PAIR_TEXTS = ["12+7=19", "12+7=91", "3+4=1", "3+4=7"]

JUDGE_KEY = "judge-secret-7f3a9c"  # a key no log, metric or config may ever show


def save_reward_model(path: Path, *, seed: int = 0, num_labels: int = 1, hidden: int = 32) -> Path:
    """A 1-layer Llama sequence classifier over the toy tokenizer, saved with it at ``path``."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1, not ~0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_reward_model_engine(root: Path, *, lora: int = 4, hidden: int = 32):
    """``(engine, base, checkpoint)``: a toy base causal LM saved with its tokenizer at
    ``root/"rm_base"``, a ``RewardModelEngine`` on it (``lora`` rank, 0: full fine-tune) trained
    one step on :data:`PAIR_TEXTS` (so a LoRA adapter is non-zero), saved with
    ``engine.save_checkpoint`` at ``root/"rm_ckpt"``."""
    from tensordict import TensorDict

    from microrl.configs import EngineConfig
    from microrl.configs.engine import LoraConfig, OptimConfig
    from microrl.configs.run import ModelConfig
    from microrl.engine import RewardModelEngine
    from microrl.run.toy_model import build_model

    tokenizer = build_tokenizer()
    size = ModelConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2, head_dim=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        build_model(size, tokenizer).save_pretrained(root / "rm_base")
        tokenizer.save_pretrained(root / "rm_base")
        config = EngineConfig(
            seed=5,
            lora=LoraConfig(rank=lora, alpha=2.0 * lora) if lora else LoraConfig(rank=0),
            optim=OptimConfig(lr=0.05),
        )
        engine = RewardModelEngine(str(root / "rm_base"), config)
        torch.nn.init.normal_(engine.module.value_head.weight, std=0.3)  # scores of order 1
        enc = tokenizer(PAIR_TEXTS, return_tensors="pt", padding=True)
        batch = TensorDict(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"].bool(),
            group=torch.tensor([0, 0, 1, 1]),
            chosen=torch.tensor([True, False, False, True]),
            batch_size=[4],
        )
        engine.train_batch(batch)
    engine.save_checkpoint(root / "rm_ckpt")
    return engine, root / "rm_base", root / "rm_ckpt"


@dataclass
class JudgeScript:
    """What the stand-in judge does: ``reply(user_message) -> text``, ``delay_s`` before each
    answer, ``fail`` (a status to answer the first ``fail_times`` requests with), the key it
    wants; and what it saw: requests, the most in flight at once, the Authorization headers."""

    reply: Callable[[str], str] = lambda content: str(len(content))
    delay_s: float = 0.0
    fail: int = 0
    fail_times: int = 0
    key: str | None = JUDGE_KEY
    requests: list[dict] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(script: JudgeScript) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with script.lock:
                script.requests.append(body)
                script.auth.append(self.headers.get("Authorization"))
                script.in_flight += 1
                script.max_in_flight = max(script.max_in_flight, script.in_flight)
                failing = script.fail and script.fail_times > 0
                script.fail_times -= bool(failing)
            try:
                time.sleep(script.delay_s)
                if script.key is not None and self.headers.get("Authorization") != (
                    f"Bearer {script.key}"
                ):
                    self._send(401, {"error": {"message": "Unauthorized", "type": "auth"}})
                elif failing:
                    self._send(script.fail, {"error": {"message": "try again", "type": "busy"}})
                else:
                    content = script.reply(body["messages"][0]["content"])
                    self._send(200, _completion(body["model"], content))
            finally:
                with script.lock:
                    script.in_flight -= 1

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                pass

        def log_message(self, *args) -> None:
            pass

    return Handler


def _completion(model: str, content: str) -> dict:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


@contextmanager
def judge_server(script: JudgeScript) -> Iterator[str]:
    """A stand-in judge serving ``script`` on localhost: its base URL (``.../v1``)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
