"""The teacher of on-policy distillation: the log-probs of the student's sampled tokens under a
frozen model (docs/recipes.md#teachers).

:class:`EngineTeacher` scores with a frozen engine in this process (at ``teacher.temperature``),
:class:`VLLMTeacher` with a ``vllm serve`` server's prompt log-probs (temperature 1), the user's
or one started on localhost. Both return ``[B, T]`` float32 token-aligned log-probs, 0 off
``loss_mask``, so they are interchangeable (tests/run/test_teacher_vllm.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from microrl.configs.engine import ActorConfig, LoraConfig
from microrl.configs.rollout import VLLMConfig
from microrl.configs.teacher import TeacherConfig
from microrl.engine import ActorEngine
from microrl.engine.setup import resolve_device
from microrl.hub import download_on_main, is_hub_name
from microrl.rollout.samplers import vllm_options
from microrl.rollout.weights.sync_check import probe_rows, rows_to_probe_layout
from microrl.run.dist import Dist
from microrl.run.toy_model import is_checkpoint

__all__ = [
    "TEACHER_LOGPROBS_KEY",
    "EngineTeacher",
    "Teacher",
    "VLLMTeacher",
    "check_same_vocabulary",
    "make_teacher",
    "teacher_checkpoint",
]

#: The batch key holding the teacher's log-probs of the sampled tokens ``[B, T]``.
TEACHER_LOGPROBS_KEY = "teacher_logprobs"
# The keys a teacher reads: the tokens and where they stand, never the student's temperature.
_SCORED_KEYS = ("input_ids", "attention_mask", "position_ids", "loss_mask")
# Concurrent prompt-log-prob requests to one vLLM server (it batches them itself).
_REQUESTS_IN_FLIGHT = 32


class Teacher(Protocol):
    """Scores sampled tokens: ``score(batch) -> [B, T]`` log-probs; ``close()`` frees it."""

    def score(self, batch: TensorDict) -> torch.Tensor: ...

    def close(self) -> None: ...


def check_same_vocabulary(
    student_tokenizer: Any, teacher_tokenizer: Any, teacher_path: str
) -> None:
    """``ValueError`` naming both vocabularies (sizes and a token that differs) unless the two
    tokenizers map every token to the same id: a teacher's log-probs of other ids than the
    student sampled would be a meaningless advantage (cross-tokenizer alignment is not done)."""
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student == teacher:
        return
    differing = next(
        (t for t in sorted(student, key=student.get) if teacher.get(t) != student[t]), None
    )
    if differing is not None:
        example = (
            f"token {differing!r} is id {student[differing]} in the student's and "
            f"{teacher.get(differing, 'missing')} in the teacher's"
        )
    else:
        extra = next(t for t in sorted(teacher, key=teacher.get) if t not in student)
        example = f"the teacher's token {extra!r} (id {teacher[extra]}) is not in the student's"
    raise ValueError(
        f"teacher.path={teacher_path!r} has another vocabulary than the student: the student's "
        f"tokenizer ({type(student_tokenizer).__name__}) has {len(student)} tokens, the "
        f"teacher's ({type(teacher_tokenizer).__name__}) {len(teacher)}; {example}. "
        "On-policy distillation needs a teacher with the student's tokenizer"
    )


def scored_batch(batch: TensorDict, temperature: float) -> TensorDict:
    """The keys a teacher reads from a rollout batch, and ``temperature`` per row ``[B]``."""
    keys = [k for k in _SCORED_KEYS if k in batch]
    out = batch.select(*keys)
    out["temperature"] = torch.full(
        (batch.batch_size[0],), float(temperature), device=batch["input_ids"].device
    )
    return out


class EngineTeacher:
    """A frozen engine of ``config.path`` (a local checkpoint) in this process, computing like
    the student's (``actor``'s device, dtypes, kernels and parallel layout; stored in
    ``actor.base_dtype``; no LoRA, no optimizer). Under ``torchrun`` it is loaded and sharded as
    the student is (no GPU holds the whole teacher) and :meth:`score` is collective."""

    def __init__(self, config: TeacherConfig, actor: ActorConfig) -> None:
        # The student's token budget when it has one (the memory plan's), else rows.
        budget = actor.max_tokens_per_micro_batch
        engine_config = dataclasses.replace(
            actor,
            micro_batch_size=None if budget else config.micro_batch_size,
            max_tokens_per_micro_batch=budget,
            temperature=config.temperature,
            lora=LoraConfig(rank=0),
            base_dtype="float32",  # validated as a full fine-tune's (set below)
            gradient_checkpointing=False,
            activation_offload=False,
            fuse_loss=False,
        )
        # Stored like the student's frozen base (16-bit there): the config refuses a 16-bit
        # base without LoRA because trained weights need fp32 masters; these never train.
        engine_config.base_dtype = actor.base_dtype
        self.temperature = config.temperature
        # A path, not a model object: the engine's rank-0 load under torchrun.
        self.engine = ActorEngine(config.path, engine_config, frozen=True)

    def score(self, batch: TensorDict) -> torch.Tensor:
        """The teacher's log-probs of ``batch``'s tokens at ``teacher.temperature``, ``[B, T]``
        float32 on the batch's device, 0 off ``loss_mask``."""
        out = self.engine.infer_batch(scored_batch(batch, self.temperature))["logprobs"]
        return torch.where(batch["loss_mask"].bool(), out.to(batch["input_ids"].device), 0.0)

    def close(self) -> None:
        self.engine = None


class VLLMTeacher:
    """The prompt log-probs of a ``vllm serve`` server of ``config.path``: the user's at
    ``config.server.url`` (key: in ``$<config.server.api_key_env>``), or one started on
    localhost with the rollout's ``vllm`` settings, on ``device``'s GPU as a colocated rollout
    server is (:func:`~microrl.rollout.samplers.vllm_placement.server_gpus`)."""

    def __init__(
        self,
        config: TeacherConfig,
        *,
        vllm: VLLMConfig | None = None,
        device: torch.device | str = "cpu",
        num_threads: int = 1,
        timeout_s: float = 600.0,
        log_dir: str | None = None,
    ) -> None:
        # The HTTP client and launcher live with the out-of-process samplers.
        from microrl.rollout.samplers.vllm_http import ServerClient
        from microrl.rollout.samplers.vllm_launch import LocalVLLMServer
        from microrl.rollout.samplers.vllm_placement import cuda_visible_devices, server_gpus

        self.server = None
        if config.server.url:
            key = config.server.api_key()
            self.client = ServerClient(config.server.url, key, timeout_s=timeout_s)
            if key:  # errors name where the key came from
                variable = config.server.api_key_env
                self.client.key_source = f"${variable}, named by teacher.server.api_key_env"
        else:
            vllm = vllm or VLLMConfig()
            device = torch.device(device)
            on_cpu = device.type == "cpu"
            gpus = server_gpus(device, num_workers=1)
            self.server = LocalVLLMServer(
                config.path,
                full_weights=False,
                num_threads=num_threads,
                timeout_s=timeout_s,
                name="the teacher's local vLLM server",
                log_dir=log_dir,
                # auto: exact on a CPU, bf16 on a GPU
                dtype=vllm.dtype if vllm.dtype != "auto" else "float32" if on_cpu else "bfloat16",
                **vllm_options.config_options(vllm, device),
                cuda_visible_devices=None if gpus is None else cuda_visible_devices(gpus[0]),
            )
            self.client = self.server.client
        self._pool = ThreadPoolExecutor(_REQUESTS_IN_FLIGHT, thread_name_prefix="microrl-teacher")

    def score(self, batch: TensorDict) -> torch.Tensor:
        """The server's log-probs of ``batch``'s tokens (temperature 1), ``[B, T]`` float32 on
        the batch's device, 0 off ``loss_mask``."""
        from microrl.rollout.samplers.vllm_requests import (
            GENERATE_ROUTE,
            probe_body,
            prompt_logprobs,
        )

        host = batch.select("input_ids", "attention_mask", "loss_mask").to("cpu")
        rows = probe_rows(host)

        def request(row: list[int]) -> list[float]:
            return prompt_logprobs(self.client.post(GENERATE_ROUTE, probe_body(row, None)), row)

        scored = list(self._pool.map(request, rows))
        return rows_to_probe_layout(host, scored).to(batch["input_ids"].device)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()


def teacher_checkpoint(
    config: TeacherConfig, dist_info: Dist | None = None, log: Callable[[str], None] = print
) -> str:
    """The local checkpoint directory of ``teacher.path``: the path itself, or a Hub id's
    snapshot in the Hugging Face cache, downloaded once (the main process first,
    :func:`microrl.hub.download_on_main`; only the config and tokenizer when
    ``teacher.server.url`` serves the weights). Collective under ``torchrun`` for a Hub id.

    Raises:
        ValueError: naming ``teacher.path``: a local directory with no checkpoint, a path that
            does not exist and is no Hub id, or a failed download.
    """
    path = config.path
    if is_checkpoint(path):
        return path
    if os.path.isdir(path):
        raise ValueError(
            f"teacher.path={path!r} holds no transformers checkpoint (config.json and a "
            "tokenizer): give a local checkpoint directory or a Hugging Face Hub id"
        )
    if is_hub_name(path):
        weights = not config.server.url  # a server the user started holds the weights
        return download_on_main(path, "teacher.path", dist_info or Dist(), log, weights=weights)
    raise ValueError(
        f"teacher.path={path!r} does not exist: give a local checkpoint directory or a Hugging "
        "Face Hub id (e.g. Qwen/Qwen2.5-7B-Instruct); to download a Hub model into it: "
        f"`hf download <org/name> --local-dir {path}`"
    )


def make_teacher(
    config: TeacherConfig,
    actor: ActorConfig,
    student_tokenizer: Any,
    *,
    vllm: VLLMConfig | None = None,
    num_threads: int = 1,
    timeout_s: float = 600.0,
    log_dir: str | None = None,
    dist_info: Dist | None = None,
    log: Callable[[str], None] = print,
) -> Teacher:
    """The teacher ``config`` describes, its checkpoint found or downloaded
    (:func:`teacher_checkpoint`, collective under ``torchrun`` for a Hub id; ``dist_info``:
    the run's ranks, None in one process) and its tokenizer checked against the student's
    (:func:`check_same_vocabulary`)."""
    from transformers import AutoTokenizer

    local = teacher_checkpoint(config, dist_info, log)
    check_same_vocabulary(student_tokenizer, AutoTokenizer.from_pretrained(local), config.path)
    config = dataclasses.replace(config, path=local)
    if config.backend == "engine":
        return EngineTeacher(config, actor)
    return VLLMTeacher(
        config,
        vllm=vllm,
        device=resolve_device(actor),
        num_threads=num_threads,
        timeout_s=timeout_s,
        log_dir=log_dir,
    )
