"""The table of what composes (microrl/configs/refusals.py): every row is live (its example is
refused naming its key, at load or, for images, at start), names only keys that exist, and
docs/recipes.md shows the table as it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from microrl.configs.examples import GRPOExampleConfig, PPOExampleConfig
from microrl.configs.loader import describe_config, load_config
from microrl.configs.refusals import REFUSALS, check_refusals, refusals_markdown

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = {"grpo": GRPOExampleConfig, "ppo": PPOExampleConfig}
KEYS = {key for schema in SCHEMAS.values() for key, _, _ in describe_config(schema())}
SECTIONS = {key.rsplit(".", n)[0] for key in KEYS for n in range(1, key.count(".") + 1)}
# A dotted config key in a row's text (file paths and module names are not).
KEY_IN_TEXT = re.compile(
    r"\b(?:model|task|rollout|actor|critic|gae|train|output|teacher)\.[\w.]*\w"
)


def _rows(recipe: str) -> list:
    return [row for row in REFUSALS if recipe in row.recipes]


@pytest.mark.parametrize(
    ("recipe", "row"),
    [(r, row) for r in SCHEMAS for row in _rows(r)],
    ids=[f"{r}-{row.key}-{i}" for r in SCHEMAS for i, row in enumerate(_rows(r))],
)
def test_every_row_refuses_its_example_naming_its_key(recipe, row) -> None:
    schema = SCHEMAS[recipe]
    expected = rf"^{re.escape(row.key)} must be {re.escape(row.must)}"
    if row.scope == "images":
        cfg = load_config(schema, None, list(row.example))  # composes without images
        with pytest.raises(ValueError, match=expected):
            check_refusals("images", cfg, facts={"vllm_vision": "no torchvision"})
        return
    with pytest.raises(ValueError) as info:
        load_config(schema, None, list(row.example))
    message = str(info.value)
    assert message.startswith(f"bad value for config key '{row.key}': ")
    assert re.search(expected, message.split(": ", 1)[1]), message


def test_every_key_a_row_names_exists() -> None:
    for row in REFUSALS:
        assert row.key in KEYS, row.key
        named = KEY_IN_TEXT.findall(f"{row.must} {row.why}")
        unknown = [key for key in named if key not in KEYS and key not in SECTIONS]
        assert not unknown, (row.key, unknown)


def test_the_vision_preset_samples_images_where_vllm_can() -> None:
    preset = ROOT / "configs" / "presets" / "qwen2.5-vl-3b-instruct.yaml"
    cfg = load_config(GRPOExampleConfig, preset, ["rollout.backend=vllm"])
    check_refusals("images", cfg, facts={"vllm_vision": None})  # its teacher and agent are off
    cfg = load_config(
        GRPOExampleConfig, preset, ["rollout.backend=vllm", "rollout.max_staleness=1"]
    )
    check_refusals("images", cfg, facts={"vllm_vision": None})  # ahead too: not refused


def test_docs_show_the_table_as_it_is() -> None:
    text = (ROOT / "docs" / "recipes.md").read_text()
    start, end = "<!-- refusals: start -->\n", "<!-- refusals: end -->"
    shown = text[text.index(start) + len(start) : text.index(end)]
    assert shown == refusals_markdown(), (
        "docs/recipes.md#what-composes is stale: replace the table between its markers with "
        "the output of `python -m microrl.configs.refusals`"
    )


@pytest.mark.parametrize("staleness", ["0", "1"])
def test_routing_replay_composes_with_an_agent(staleness) -> None:
    """Agent rows carry their turns' routing (tests/agents/test_runner_routing.py)."""
    overrides = ["model.toy_arch=moe", "task.agent.function=m:f", "rollout.routing_replay=true"]
    cfg = load_config(GRPOExampleConfig, None, [*overrides, f"rollout.max_staleness={staleness}"])
    assert cfg.rollout.routing_replay and cfg.task.agent.enabled


def test_an_unknown_scope_is_an_error() -> None:
    with pytest.raises(ValueError, match="scope must be one of"):
        check_refusals("recipes", GRPOExampleConfig())
