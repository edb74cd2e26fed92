"""Old config keys (before ``task`` nested and the endpoints became one type) keep loading for one
release: from a YAML file, a ``key=value`` override and a run's saved config, each with a
``FutureWarning`` naming the new key; an API key written in a config goes to an environment
variable, never to a saved config or a message; an unknown key is still an error naming it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import config_to_yaml, format_value, load_config, renamed_keys

# A value for every new key an old one maps to, none of them the default, which compose.
NEW_VALUES = {
    "task.dataset.train_file": "data/train.jsonl",
    "task.dataset.eval_file": "data/eval.jsonl",
    "task.dataset.config": "main",
    "task.dataset.train_split": "tr",
    "task.dataset.eval_split": "te",
    "task.dataset.prompt_field": "question",
    "task.dataset.answer_field": "solution",
    "task.dataset.chat_template": True,
    "task.images.field": "picture",
    "task.images.marker": "<image>",
    "task.images.max_pixels": 4096,
    "task.rewards.functions": ["my_reward:score"],
    "task.rewards.weights": [1.0, 0.5],
    "task.rewards.overlong_buffer": 0,
    "task.rewards.overlong_penalty": 0.5,
    "task.reward_model.path": "my/rm",
    "task.reward_model.base": "my/base",
    "task.reward_model.norm": "group",
    "task.reward_model.batch_size": 3,
    "task.reward_model.chat_template": True,
    "task.agent.function": "my_agent:play",
    "task.agent.timeout_s": 5.0,
    "task.agent.max_concurrency": 3,
    "task.agent.host": "0.0.0.0",
    "task.agent.tool_parser": "hermes",
    "rollout.server.url": "http://h:8000",
    "teacher.server.url": "http://t:8000",
}
# What the keys above need to compose (new keys, not renamed).
CONTEXT = {"task.name": "dataset", "rollout.backend": "vllm", "rollout.max_staleness": 1}
# A teacher refuses an agent's episodes: its server is checked in a run of its own.
TEACHER = {"teacher.path": "my/teacher", "teacher.backend": "vllm"}
SECRETS = ("rollout.server_api_key", "teacher.server_api_key")


def _overrides(values: dict) -> list[str]:
    return [f"{key}={format_value(value)}" for key, value in values.items()]


def _setting(new: str) -> dict:
    """New keys and values that compose, ``new`` among them."""
    if new.startswith("teacher."):
        return {**TEACHER, new: NEW_VALUES[new]}
    return {**CONTEXT, **{k: v for k, v in NEW_VALUES.items() if not k.startswith("teacher.")}}


def _get(config, key: str):
    for name in key.split("."):
        config = getattr(config, name)
    return config


def test_the_changelog_lists_every_old_key_with_its_new_one() -> None:
    changelog = (Path(__file__).resolve().parents[2] / "docs" / "changelog.md").read_text()
    for old, new in renamed_keys(GRPOExampleConfig).items():
        assert f"| `{old}` | `{new}` |" in changelog, old


def test_every_old_key_is_listed_with_its_new_one() -> None:
    old_to_new = renamed_keys(GRPOExampleConfig)
    assert set(old_to_new.values()) - set(NEW_VALUES) == {
        "rollout.server.api_key_env",
        "teacher.server.api_key_env",
    }
    assert {k: v for k, v in renamed_keys(PPOExampleConfig).items() if k.startswith("task.")} == {
        k: v for k, v in old_to_new.items() if k.startswith("task.")
    }


@pytest.mark.parametrize(
    ("old", "new"),
    [(o, n) for o, n in renamed_keys(GRPOExampleConfig).items() if o not in SECRETS],
)
def test_an_old_key_on_the_command_line_sets_the_new_one_with_a_warning(old, new) -> None:
    setting = _setting(new)
    others = {k: v for k, v in setting.items() if k != new}
    with pytest.warns(FutureWarning, match=rf"{old} -> {new}(,|$)"):
        config = load_config(GRPOExampleConfig, None, _overrides({**others, old: setting[new]}))
    assert _get(config, new) == NEW_VALUES[new]
    assert config == load_config(GRPOExampleConfig, None, _overrides(setting))


def _node(tree: dict, names: list[str]) -> dict:
    for name in names:
        tree = tree[name]
    return tree


def _old_saved_config(tmp_path: Path) -> tuple[Path, GRPOExampleConfig]:
    """A run's saved config as the release before wrote it (every key, the old names, the
    servers' keys written in), and the config it means."""
    new = load_config(GRPOExampleConfig, None, _overrides(_setting("task.name")))
    tree = yaml.safe_load(config_to_yaml(new))
    values = {}
    for old, key in renamed_keys(GRPOExampleConfig).items():
        if old not in SECRETS:
            *section, leaf = key.split(".")
            values[old] = _node(tree, section).pop(leaf)
    for name in ("dataset", "images", "rewards", "reward_model", "agent"):
        assert tree["task"].pop(name) == {}  # every key of the nested sections was renamed
    for old, value in values.items():
        *section, leaf = old.split(".")
        _node(tree, section)[leaf] = value
    for section in ("rollout", "teacher"):
        del tree[section]["server"]  # the old configs have none
        tree[section]["server_api_key"] = f"s3cret-{section}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path, new


def test_a_saved_config_of_the_old_keys_resumes_and_its_api_keys_stay_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = _old_saved_config(tmp_path)
    for variable in ("MICRORL_ROLLOUT_SERVER_API_KEY", "MICRORL_TEACHER_SERVER_API_KEY"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.warns(FutureWarning) as caught:
        config = load_config(GRPOExampleConfig, path)
    message = " ".join(str(w.message) for w in caught)
    for old, new in renamed_keys(GRPOExampleConfig).items():
        assert f"{old} -> {new}" in message
    assert "s3cret" not in message
    # The keys are read from the environment of this process, as the new form reads them.
    assert config.rollout.server.api_key_env == "MICRORL_ROLLOUT_SERVER_API_KEY"
    assert config.rollout.server.api_key() == "s3cret-rollout"
    assert config.teacher.server.api_key() == "s3cret-teacher"
    assert os.environ["MICRORL_TEACHER_SERVER_API_KEY"] == "s3cret-teacher"
    assert "s3cret" not in config_to_yaml(config)  # the run saves the variable's name only
    for section in ("rollout", "teacher"):
        getattr(expected, section).server.api_key_env = getattr(config, section).server.api_key_env
    assert config == expected


def test_an_empty_old_api_key_is_dropped_and_the_default_variable_kept() -> None:
    with pytest.warns(FutureWarning, match=r"rollout.server_api_key -> rollout.server.api_key_env"):
        config = load_config(GRPOExampleConfig, None, ["rollout.server_api_key="])
    assert config.rollout.server.api_key_env == "VLLM_API_KEY"


def test_the_new_key_given_beside_the_old_one_wins() -> None:
    with pytest.warns(FutureWarning):
        config = load_config(
            GRPOExampleConfig, None, ["task.agent_timeout_s=5", "task.agent.timeout_s=7"]
        )
    assert config.task.agent.timeout_s == 7


def test_an_old_key_with_a_bad_value_names_the_new_key() -> None:
    with pytest.warns(FutureWarning), pytest.raises(ValueError) as info:
        load_config(GRPOExampleConfig, None, ["task.agent_timeout_s=soon"])
    assert str(info.value).startswith("bad value for config key 'task.agent.timeout_s'")


@pytest.mark.parametrize(
    ("override", "key", "suggested"),
    [
        ("task.dataset.train_fil=x.jsonl", "task.dataset.train_fil", "train_file"),
        ("task.trian_file=x.jsonl", "task.trian_file", "train_file"),
        ("rollout.server.urls=http://h:1", "rollout.server.urls", "url"),
    ],
)
def test_an_unknown_key_is_still_an_error_naming_it(override, key, suggested) -> None:
    with pytest.raises(ValueError) as info:
        load_config(GRPOExampleConfig, None, [override])
    message = str(info.value)
    assert message.startswith(f"invalid config key '{key}'")
    assert "Did you mean" in message and suggested in message
