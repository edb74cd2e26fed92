"""The ``teacher`` section: on-policy distillation from a frozen teacher (docs/recipes.md#teachers).

The student (the trained policy) samples; the teacher scores the sampled tokens; the per-token
reverse KL ``log pi_teacher - log pi_student`` is an advantage mixed into the task's
(:func:`microrl.losses.distillation_advantages`). ``path`` empty: no teacher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from microrl.configs.endpoint import EndpointConfig
from microrl.configs.fields import config_field, require
from microrl.configs.refusals import check_refusals

__all__ = ["TEACHER_BACKENDS", "TeacherConfig"]

#: ``engine``: a frozen ActorEngine in the trainer process; ``vllm``: a ``vllm serve`` server's
#: prompt log-probs.
TEACHER_BACKENDS = ("engine", "vllm")


def _teacher_server() -> EndpointConfig:
    return EndpointConfig(api_key_env="VLLM_API_KEY")


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (GRPO recipe; docs/recipes.md#teachers).

    ``server``: with ``backend=vllm``, a ``vllm serve`` server of ``path`` that the user started
    (empty ``server.url``: microrl starts one on localhost)."""

    #: Keys before the endpoint type (``server``), read by the loader for one release.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {"server_url": "server.url"}
    SECRET_KEYS: ClassVar[dict[str, str]] = {"server_api_key": "server"}

    path: str = config_field(
        "",
        "the teacher: a local checkpoint or a Hugging Face Hub id with the student's tokenizer "
        "(empty: no teacher)",
    )
    backend: str = config_field(
        "engine", "engine (a frozen engine in the trainer process) or vllm (a vllm serve server)"
    )
    coef: float = config_field(
        1.0,
        "weight of the per-token reverse-KL advantage added to the task's (0: pure RL, the "
        "teacher only reported as teacher/reverse_kl)",
    )
    task_reward: bool = config_field(
        True, "keep the task's advantage (false: pure on-policy distillation)"
    )
    gamma: float = config_field(
        0.0,
        "discount of the reverse-KL reward over later tokens (0: each token's own, the usual)",
    )
    temperature: float = config_field(
        1.0,
        "the teacher's temperature (its log-probs of the sampled tokens at it; the student's are "
        "at actor.temperature; vllm: 1 only)",
    )
    micro_batch_size: int = config_field(
        64, "engine: rows per teacher forward (actor.max_tokens_per_micro_batch when set)"
    )
    server: EndpointConfig = field(default_factory=_teacher_server)

    @property
    def enabled(self) -> bool:
        """Whether a teacher is configured."""
        return bool(self.path)

    def __post_init__(self) -> None:
        require(
            self.backend in TEACHER_BACKENDS,
            "teacher.backend",
            f"one of {', '.join(TEACHER_BACKENDS)}",
            self.backend,
        )
        require(
            isinstance(self.coef, (int, float)) and 0 <= self.coef < float("inf"),
            "teacher.coef",
            "a finite float >= 0",
            self.coef,
        )
        require(
            isinstance(self.task_reward, bool), "teacher.task_reward", "a bool", self.task_reward
        )
        require(0 <= self.gamma <= 1, "teacher.gamma", "in [0, 1]", self.gamma)
        require(self.temperature > 0, "teacher.temperature", "> 0", self.temperature)
        require(
            self.micro_batch_size >= 1, "teacher.micro_batch_size", ">= 1", self.micro_batch_size
        )
        # vLLM's prompt log-probs are the model's raw ones, at temperature 1.
        require(
            self.backend != "vllm" or self.temperature == 1.0,
            "teacher.temperature",
            "1.0 with teacher.backend=vllm (vLLM's prompt log-probs are at temperature 1; "
            "use teacher.backend=engine for another)",
            self.temperature,
        )
        self.server.check("teacher.server")
        if not self.enabled:
            require(
                self.task_reward,
                "teacher.task_reward",
                "true without a teacher (set teacher.path for pure distillation)",
                self.task_reward,
            )
        require(
            self.task_reward or self.coef > 0,
            "teacher.coef",
            "> 0 with teacher.task_reward=false (nothing else would be learnt)",
            self.coef,
        )
        check_refusals("teacher", self)
