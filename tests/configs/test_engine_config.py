"""Engine config: micro-batching modes, validation messages that name the key."""

import pytest

from microrl.configs import ActorConfig, CriticConfig
from microrl.configs.engine import DEFAULT_MICRO_BATCH_SIZE, OptimConfig
from microrl.configs.run import RolloutConfig


def test_micro_batching_defaults_to_rows_and_a_token_budget_alone_is_enough() -> None:
    assert ActorConfig().micro_batch_size == DEFAULT_MICRO_BATCH_SIZE
    budget = ActorConfig(max_tokens_per_micro_batch=256)
    assert budget.micro_batch_size is None and budget.max_tokens_per_micro_batch == 256


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"micro_batch_size": 2, "max_tokens_per_micro_batch": 64}, "max_tokens_per_micro_batch"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "seq_len_norm"),
        ({"temperature": 0.0}, "temperature"),
        ({"dtype": "fp8"}, "dtype"),
    ],
)
def test_bad_actor_config_names_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ActorConfig(**kwargs)


def test_bad_critic_config_names_the_key() -> None:
    with pytest.raises(ValueError, match="cliprange_value"):
        CriticConfig(cliprange_value=-1.0)


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: ActorConfig(optim=OptimConfig(cpu_offload="yes")), "optim.cpu_offload"),
        (lambda: ActorConfig(freeze_vision="false"), "freeze_vision"),
        (lambda: CriticConfig(routing_replay=1), "routing_replay"),
        (lambda: ActorConfig(activation_offload="no"), "activation_offload"),
        (lambda: ActorConfig(mask_truncated=0), "mask_truncated"),
        (lambda: RolloutConfig(dynamic_sampling="true"), "rollout.dynamic_sampling"),
        (lambda: RolloutConfig(routing_replay="off"), "rollout.routing_replay"),
    ],
)
def test_a_flag_that_is_not_a_bool_is_refused_by_its_key(build, key: str) -> None:
    """A YAML string such as "false" is truthy: every flag must be a real bool."""
    with pytest.raises(ValueError, match=rf"^{key} must be a bool \(true or false\), got "):
        build()
