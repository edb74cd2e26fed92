"""Engine config: micro-batching modes, validation messages that name the key."""

import pytest

from microrl.configs import ActorConfig, CriticConfig
from microrl.configs.engine import DEFAULT_MICRO_BATCH_SIZE


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
