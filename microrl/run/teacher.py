"""The teacher of on-policy distillation: the log-probs of the student's sampled tokens under a
frozen model (docs/recipes.md#teachers).

:class:`EngineTeacher` scores with a frozen :class:`~microrl.engine.ActorEngine` in this
process (the batch's per-row ``temperature`` at ``teacher.temperature``, the engine's one
micro-batch path); :class:`VLLMTeacher` with a ``vllm serve`` server's prompt log-probs of the
rows' token ids (``/inference/v1/generate``, ``prompt_logprobs=0``: the sampled tokens' own,
at temperature 1), on the user's server (``teacher.server_url``) or one started on localhost.
Both return ``[B, T]`` float32 token-aligned log-probs, 0 off ``loss_mask``, so they are
interchangeable (tests/run/test_teacher_vllm.py). :func:`check_same_vocabulary` refuses a
teacher whose tokenizer differs from the student's: its log-probs would score other tokens.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from microrl.configs.engine import ActorConfig, LoraConfig
from microrl.configs.rollout import VLLMConfig
from microrl.configs.teacher import TeacherConfig
from microrl.engine import ActorEngine
from microrl.engine.rollout import vllm_options
from microrl.engine.rollout.sync_check import probe_rows, rows_to_probe_layout
from microrl.engine.setup import base_dtype, load_causal_lm, resolve_device

__all__ = [
    "TEACHER_LOGPROBS_KEY",
    "EngineTeacher",
    "Teacher",
    "VLLMTeacher",
    "check_same_vocabulary",
    "make_teacher",
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
    the student's (``actor``'s device, dtypes, kernels and parallel layout; its weights stored
    in ``actor.base_dtype``, as the student's frozen base; no LoRA, no optimizer steps).

    Under ``torchrun`` its :meth:`score` is collective (the weights are FSDP2-sharded as the
    student's): every rank calls it in the same order."""

    def __init__(self, config: TeacherConfig, actor: ActorConfig) -> None:
        # The student's token budget when it has one (the memory plan's), else rows.
        budget = actor.max_tokens_per_micro_batch
        engine_config = dataclasses.replace(
            actor,
            micro_batch_size=None if budget else config.micro_batch_size,
            max_tokens_per_micro_batch=budget,
            temperature=config.temperature,
            lora=LoraConfig(rank=0),
            base_dtype="float32",  # a model object keeps the dtype it is loaded in
            gradient_checkpointing=False,
            activation_offload=False,
            fuse_loss=False,
        )
        self.temperature = config.temperature
        # Stored like the student's frozen base (16-bit there: no master weights to keep).
        model = load_causal_lm(config.path, base_dtype(actor))
        self.engine = ActorEngine(model, engine_config)
        self.engine.module.requires_grad_(False)  # frozen: no gradient is ever formed

    def score(self, batch: TensorDict) -> torch.Tensor:
        """The teacher's log-probs of ``batch``'s tokens at ``teacher.temperature``, ``[B, T]``
        float32 on the batch's device, 0 off ``loss_mask``."""
        out = self.engine.infer_batch(scored_batch(batch, self.temperature))["logprobs"]
        return torch.where(batch["loss_mask"].bool(), out.to(batch["input_ids"].device), 0.0)

    def close(self) -> None:
        self.engine = None


class VLLMTeacher:
    """The prompt log-probs of a ``vllm serve`` server of ``config.path``: the user's at
    ``config.server_url`` (key ``config.server_api_key`` or ``$VLLM_API_KEY``), or a server
    started on localhost (``vllm``: the rollout's vLLM settings; ``device``: where it runs)."""

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
        from microrl.remote.trainer.vllm_http import ServerClient
        from microrl.remote.trainer.vllm_launch import LocalVLLMServer

        self.server = None
        if config.server_url:
            self.client = ServerClient(
                config.server_url, config.server_api_key or None, timeout_s=timeout_s
            )
            if config.server_api_key:  # errors name the key the user set
                self.client.key_source = "teacher.server_api_key"
        else:
            vllm = vllm or VLLMConfig()
            device = torch.device(device)
            on_cpu = device.type == "cpu"
            self.server = LocalVLLMServer(
                config.path,
                full_weights=False,
                num_threads=num_threads,
                timeout_s=timeout_s,
                name="the teacher's local vLLM server",
                log_dir=log_dir,
                dtype="float32" if vllm.dtype == "auto" and on_cpu else _dtype(vllm.dtype),
                max_model_len=vllm.max_model_len,
                kv_cache_mb=vllm_options.kv_cache_mb(vllm, device),
                gpu_memory_utilization=vllm.gpu_memory_utilization,
                enforce_eager=vllm_options.enforce_eager(vllm, device),
                cpu=on_cpu,
            )
            self.client = self.server.client
        self._pool = ThreadPoolExecutor(_REQUESTS_IN_FLIGHT, thread_name_prefix="microrl-teacher")

    def score(self, batch: TensorDict) -> torch.Tensor:
        """The server's log-probs of ``batch``'s tokens (temperature 1), ``[B, T]`` float32 on
        the batch's device, 0 off ``loss_mask``."""
        from microrl.remote.trainer.vllm_requests import (
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


def _downloaded(name: str) -> str:
    from microrl.hub import download_hint, download_model, is_hub_name

    if not is_hub_name(name):
        raise ValueError(
            f"teacher.path={name!r} is neither a local checkpoint directory nor a Hugging Face "
            "Hub id (org/name)"
        )
    try:
        return download_model(name)
    except Exception as err:  # network, unknown or gated repository: one line
        raise ValueError(
            f"teacher.path={name!r} is not a local directory, and downloading it from the "
            f"Hugging Face Hub failed ({err}); download it with {download_hint(name)} and give "
            "teacher.path the local directory"
        ) from err


def _dtype(requested: str) -> str:
    return "bfloat16" if requested == "auto" else requested


def make_teacher(
    config: TeacherConfig,
    actor: ActorConfig,
    student_tokenizer: Any,
    *,
    vllm: VLLMConfig | None = None,
    num_threads: int = 1,
    timeout_s: float = 600.0,
    log_dir: str | None = None,
) -> Teacher:
    """The teacher ``config`` describes, once its tokenizer is checked against the student's
    (:func:`check_same_vocabulary`)."""
    from transformers import AutoTokenizer

    check_same_vocabulary(
        student_tokenizer, AutoTokenizer.from_pretrained(config.path), config.path
    )
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
