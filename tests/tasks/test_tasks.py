"""Bring your own task: prompt files, reward functions by import path, the word-problem task.

- ``task.name=dataset`` reads JSONL and Parquet files with the configured fields, holds out an
  eval split (or reads an eval file) and renders a chat template;
- reward functions resolve from ``module:function`` and ``file.py:function``, are called on the
  batch, are summed with weights, and every bad input is an error naming its config key;
- the built-in word problems are deterministic, hold out a disjoint set and are scored by the
  last number of the response;
- the default task is exactly the addition task of before (same prompts, same token ids);
- a tokenizer that does not decode the task's prompts back to their text is an error naming
  ``model.path``.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.configs.run import ModelConfig, TaskConfig
from microrl.configs.task import DatasetConfig, RewardsConfig
from microrl.run.toy_model import SPECIAL_TOKENS, build_tokenizer
from microrl.tasks import (
    AdditionTask,
    DatasetTask,
    Problem,
    RewardedTask,
    RewardError,
    Task,
    WordProblemTask,
    load_reward,
    make_task,
    resolve_reward_fn,
)
from microrl.tasks.rewards import exact_match, numeric_match, parse_number
from microrl.tasks.word_problems import WORD_ALPHABET

ROWS = [{"question": f"{a}+{a + 1}=", "solution": 2 * a + 1} for a in range(30)]
CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ``my_reward.py`` in a fresh working directory, as a user writes it; the module name."""
    (tmp_path / "my_reward.py").write_text(
        "def score(completions, answers, prompts):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answers)]\n\n"
        "def length(completions):\n"
        "    return [float(len(c)) for c in completions]\n\n"
        "def wrong_length(completions, **kwargs):\n"
        "    return [0.0]\n\n"
        "def nan(completions, **kwargs):\n"
        "    return [float('nan')] * len(completions)\n\n"
        "def text(completions, **kwargs):\n"
        "    return ['1'] * len(completions)\n\n"
        "def scalar(completions, **kwargs):\n"
        "    return 1.0\n\n"
        "def no_args():\n"
        "    return []\n\n"
        "NOT_A_FUNCTION = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    saved_path = list(sys.path)
    yield "my_reward"
    sys.path[:] = saved_path
    sys.modules.pop("my_reward", None)


# ----------------------------------------------------------------------------- default task
def test_the_default_task_is_the_addition_task_of_before() -> None:
    task = make_task(load_config(GRPOExampleConfig).task, build_tokenizer())
    assert type(task) is AdditionTask and isinstance(task, Task)
    before = AdditionTask(99, 500, 0)
    assert task.eval_problems() == before.eval_problems()
    assert task.sample(random.Random(7), 50) == before.sample(random.Random(7), 50)
    # The toy tokenizer is the one the main job always had: same vocabulary, same ids.
    old_vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *"0123456789+-*= "])}
    assert build_tokenizer().get_vocab() == old_vocab
    assert build_tokenizer(AdditionTask.toy_alphabet).get_vocab() == old_vocab
    words = build_tokenizer(WORD_ALPHABET).get_vocab()
    assert all(words[t] == i for t, i in old_vocab.items()) and len(words) > len(old_vocab)


# ----------------------------------------------------------------------------- dataset task
def test_jsonl_dataset_with_named_fields_and_a_held_out_split(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "train.jsonl", ROWS)
    cfg = TaskConfig(
        name="dataset",
        eval_size=5,
        dataset=DatasetConfig(
            train_file=str(path), prompt_field="question", answer_field="solution"
        ),
        rewards=RewardsConfig(functions=["microrl.tasks.rewards:exact_match"]),
    )
    task = make_task(cfg, build_tokenizer())
    assert isinstance(task, DatasetTask) and isinstance(task, Task)
    held_out = task.eval_problems()
    assert len(held_out) == 5 and task.num_train == 25
    train = {p.prompt for p in task.sample(random.Random(0), 500)}
    assert len(train) == 25 and not train & {p.prompt for p in held_out}
    assert held_out == make_task(cfg).eval_problems()  # deterministic by task.seed
    assert held_out != make_task(replace(cfg, seed=1)).eval_problems()
    assert all(p.answer == str(eval(p.prompt[:-1])) for p in held_out)  # int answers as text
    problem = held_out[0]
    assert task.score([problem.answer, "x"], [problem, problem]) == [1.0, 0.0]
    assert task.solved_threshold == 1.0


def test_parquet_train_and_eval_files(tmp_path: Path) -> None:
    train = _parquet(tmp_path / "train.parquet", ROWS[:20])
    evals = _parquet(tmp_path / "eval.parquet", ROWS[20:])
    task = DatasetTask(
        train,
        load_reward(["microrl.tasks.rewards:numeric_match"]),
        eval_file=evals,
        eval_size=4,
        prompt_field="question",
        answer_field="solution",
    )
    assert [p.prompt for p in task.eval_problems()] == [r["question"] for r in ROWS[20:24]]
    assert task.num_train == 20
    assert task.score(["it is 41."], [Problem("20+21=", "41")]) == [1.0]


def test_chat_template_renders_prompts_and_message_lists(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(WORD_ALPHABET + "<>")
    tokenizer.chat_template = CHAT
    rows = [
        {"prompt": "one plus two", "answer": "3"},
        {"prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": "4 5"}]},
    ]
    rows[1]["answer"] = "9"
    path = tmp_path / "chat.jsonl"
    _jsonl(path, rows)
    task = DatasetTask(path, exact_match, eval_file=path, chat_template=True, tokenizer=tokenizer)
    prompts = [p.prompt for p in task.eval_problems()]
    assert prompts == ["<user>one plus two<assistant>", "<system>add<user>4 5<assistant>"]
    # A template that writes the BOS itself, for a tokenizer that adds one: one BOS, not two.
    tokenizer.chat_template = "{{ bos_token }}" + CHAT
    task = DatasetTask(path, exact_match, eval_file=path, chat_template=True, tokenizer=tokenizer)
    prompt = task.eval_problems()[0].prompt
    assert prompt == "<user>one plus two<assistant>"
    assert tokenizer(prompt)["input_ids"].count(tokenizer.bos_token_id) == 1
    with pytest.raises(ValueError, match=r"task\.dataset\.chat_template"):
        DatasetTask(
            path, exact_match, eval_file=path, chat_template=True, tokenizer=build_tokenizer()
        )


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"train_file": "missing.jsonl"}, "task.dataset.train_file"),
        ({"train_file": "rows.csv"}, "task.dataset.train_file"),
        ({"eval_file": "missing.parquet"}, "task.dataset.eval_file"),
        ({"prompt_field": "text"}, "task.dataset.prompt_field"),
        ({"answer_field": "label"}, "task.dataset.answer_field"),
        ({"eval_size": 30}, "task.eval_size"),
        ({"train_file": "empty.jsonl"}, "task.dataset.train_file"),
        ({"train_file": "bad_prompt.jsonl"}, "task.dataset.prompt_field"),
        ({"functions": ["my_reward"]}, "task.rewards.functions[0]"),
    ],
)
def test_every_bad_dataset_input_names_its_key(tmp_path, monkeypatch, change, key) -> None:
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "train.jsonl", [{"prompt": r["question"], "answer": 1} for r in ROWS])
    (tmp_path / "rows.csv").write_text("prompt,answer\n1+1=,2\n")
    (tmp_path / "empty.jsonl").write_text("")
    _jsonl(tmp_path / "bad_prompt.jsonl", [{"prompt": 3, "answer": 3}])
    in_dataset = {k: v for k, v in change.items() if k not in ("eval_size", "functions")}
    dataset = {"train_file": "train.jsonl", **in_dataset}
    cfg = TaskConfig(
        name="dataset",
        eval_size=change.get("eval_size", 5),
        dataset=DatasetConfig(**dataset),
        rewards=RewardsConfig(
            functions=change.get("functions", ["microrl.tasks.rewards:exact_match"])
        ),
    )
    with pytest.raises(ValueError, match=re.escape(key)):
        make_task(cfg)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("task.name=datasets", "task.name"),
        ("task.dataset.train_file=x.jsonl", "task.dataset.train_file"),  # without task.name=dataset
        ("task.name=dataset", "task.dataset.train_file"),
        ("task.rewards.weights=[1.0]", "task.rewards.weights"),
    ],
)
def test_config_errors_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ValueError, match=rf"bad value for config key '{key}'"):
        load_config(GRPOExampleConfig, None, [override])
    with pytest.raises(ValueError, match=r"'task\.rewards\.functions'"):
        load_config(
            GRPOExampleConfig, None, ["task.name=dataset", "task.dataset.train_file=a.jsonl"]
        )


def test_reward_overrides_parse_as_lists() -> None:
    cfg = load_config(
        GRPOExampleConfig,
        None,
        [
            "task.name=dataset",
            "task.dataset.train_file=data/train.jsonl",
            "task.rewards.functions=[my_reward:score,rewards/extra.py:length]",
            "task.rewards.weights=[1,0.1]",
        ],
    )
    assert cfg.task.rewards.functions == ["my_reward:score", "rewards/extra.py:length"]
    assert cfg.task.rewards.weights == [1.0, 0.1]


def test_a_single_reward_needs_no_brackets(tmp_path: Path) -> None:
    # key=value for a list key is a one-element list, on the command line and in a file.
    cfg = load_config(
        GRPOExampleConfig,
        None,
        ["task.rewards.functions=my_reward:score", "task.rewards.weights=0.5"],
    )
    assert cfg.task.rewards.functions == ["my_reward:score"] and cfg.task.rewards.weights == [0.5]
    path = tmp_path / "task.yaml"
    path.write_text("task:\n  rewards:\n    functions: rewards/format.py:short\n")
    loaded = load_config(GRPOExampleConfig, path).task.rewards.functions
    assert loaded == ["rewards/format.py:short"]
    # Anything else that is not a list names the key and the list syntax.
    for bad in ("task.rewards.functions={a: 1}", "task.rewards.functions=null"):
        with pytest.raises(
            ValueError, match=r"'task\.rewards\.functions'.*written \[a,b\]"
        ) as info:
            load_config(GRPOExampleConfig, None, [bad])
        assert "AnyNode" not in str(info.value)


# ----------------------------------------------------------------------------- the row's columns
ROW_REWARDS = """
def by_difficulty(completions, difficulty, **kwargs):
    return [float(d) for d in difficulty]


def trl_style(prompts, completions, answer, **kwargs):
    # TRL's signature: every argument by keyword, the answer column under its own name, raw.
    assert all(isinstance(a, int) for a in answer) and "difficulty" in kwargs
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]


def old_style(completions, answers):
    return [float(c.strip() == a) for c, a in zip(completions, answers)]


def needs_a_column(completions, source):
    return [0.0] * len(completions)


def boom(completions, **kwargs):
    return [1 / 0]
"""


def test_rewards_get_the_rows_other_columns_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "row_rewards.py").write_text(ROW_REWARDS)
    rows = [{"prompt": f"{a}+1=", "answer": a + 1, "difficulty": a % 3} for a in range(12)]
    _jsonl(tmp_path / "rows.jsonl", rows)
    cfg = TaskConfig(
        name="dataset",
        eval_size=4,
        dataset=DatasetConfig(train_file="rows.jsonl"),
        rewards=RewardsConfig(
            functions=[
                "row_rewards.py:by_difficulty",
                "row_rewards.py:trl_style",
                "row_rewards.py:old_style",
            ],
            weights=[1.0, 10.0, 100.0],
        ),
    )
    task = make_task(cfg)
    problems = task.sample(random.Random(0), 6)
    assert all(p.columns["difficulty"] == int(p.prompt.split("+")[0]) % 3 for p in problems)
    responses = [p.answer if i % 2 else "wrong" for i, p in enumerate(problems)]
    expected = [p.columns["difficulty"] + 110.0 * (i % 2) for i, p in enumerate(problems)]
    assert task.score(responses, problems) == expected
    # A parameter no column fills names the entry and the columns there are.
    task = make_task(replace(cfg, rewards=RewardsConfig(["row_rewards.py:needs_a_column"])))
    with pytest.raises(
        ValueError, match=r"task\.rewards\.functions\[0\].*'source'.*answer, difficulty"
    ):
        task.score(["1"], task.eval_problems()[:1])
    # A reward that raises is named, with the exception it raised.
    task = make_task(replace(cfg, rewards=RewardsConfig(["row_rewards.py:boom"])))
    with pytest.raises(RewardError) as info:
        task.score(["1"], task.eval_problems()[:1])
    assert str(info.value) == (
        "task.rewards.functions[0]='row_rewards.py:boom' raised ZeroDivisionError: division by zero"
    )
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_a_hub_dataset_name_is_loaded_with_datasets(tmp_path: Path, monkeypatch) -> None:
    import datasets

    monkeypatch.chdir(tmp_path)
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        if path == "missing/dataset":
            raise FileNotFoundError("Dataset 'missing/dataset' doesn't exist on the Hub\nmore")
        rows = [{"question": f"q{i} {split}", "answer": str(i), "level": i} for i in range(10)]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = TaskConfig(
        name="dataset",
        eval_size=3,
        dataset=DatasetConfig(
            train_file="openai/gsm8k",
            eval_file="openai/gsm8k",
            config="main",
            prompt_field="question",
        ),
        rewards=RewardsConfig(functions=["microrl.tasks.rewards:numeric_match"]),
    )
    task = make_task(cfg)
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert [p.prompt for p in task.eval_problems()] == ["q0 test", "q1 test", "q2 test"]
    assert task.eval_problems()[1].columns == {"answer": "1", "level": 1}
    with pytest.raises(ValueError) as info:
        missing = replace(cfg.dataset, train_file="missing/dataset", eval_file=None)
        make_task(replace(cfg, dataset=missing))
    message = str(info.value)
    assert message.startswith("task.dataset.train_file='missing/dataset' could not be loaded from")
    assert "FileNotFoundError" in message and "\n" not in message
    assert "hf download missing/dataset --repo-type dataset" in message
    # A local-looking name is never sent to the Hub.
    with pytest.raises(ValueError, match=r"task\.dataset\.train_file='\./gsm8k' does not exist"):
        make_task(replace(cfg, dataset=replace(cfg.dataset, train_file="./gsm8k", eval_file=None)))
    assert len(calls) == 3


# ----------------------------------------------------------------------------- rewards
def test_rewards_resolve_from_a_module_and_a_file_and_sum_with_weights(
    reward_module: str, tmp_path: Path
) -> None:
    assert reward_module not in sys.modules
    fn = resolve_reward_fn(f"{reward_module}:score")  # found in the working directory
    assert fn(["3"], ["3"], ["1+2="]) == [1.0]
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "extra.py").write_text(
        "def bonus(completions, *, prompts):\n    return [float(len(p)) for p in prompts]\n"
    )
    reward = load_reward(
        [f"{reward_module}:score", "rewards/extra.py:bonus", f"{tmp_path}/my_reward.py:length"],
        [2.0, 0.5, -1.0],
    )
    got = reward(["3", " 4 ", "xy"], ["3", "4", "5"], ["1+2=", "2+2=", "22+33="])
    assert got == [2.0 + 2.0 - 1.0, 2.0 + 2.0 - 3.0, 0.0 + 3.0 - 2.0]
    assert load_reward([f"{reward_module}:length"])(["ab"], ["x"], ["p"]) == [2.0]  # weight 1


def test_builtin_rewards_by_path_and_numbers() -> None:
    assert resolve_reward_fn("microrl.tasks.rewards:numeric_match") is numeric_match
    assert parse_number("so 3+4=7.") == 7.0 and parse_number("-12 and 1,234.5") == 1234.5
    assert parse_number("none") is None
    assert numeric_match(["7", "7 apples", "it is 8", "", "7.0"], ["7"] * 5) == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
    ]
    assert exact_match([" 7\n", "07"], ["7", "7"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        ("my_reward", ValueError, "module:function"),
        ("my_reward:", ValueError, "module:function"),
        ("not_a_module_anywhere:score", ValueError, "no module named"),
        ("missing/file.py:score", ValueError, "does not exist"),
        ("my_reward:missing", ValueError, "has no attribute 'missing'"),
        ("my_reward:NOT_A_FUNCTION", TypeError, "not callable"),
        ("my_reward:no_args", TypeError, "completions"),
        ("my_reward:wrong_length", ValueError, "returned 1 values for 2"),
        ("my_reward:nan", ValueError, "non-finite"),
        ("my_reward:text", TypeError, "not a float"),
        ("my_reward:scalar", TypeError, "one float per completion"),
    ],
)
def test_every_bad_reward_names_its_key(reward_module, path, error, match) -> None:
    with pytest.raises(error, match=match) as info:
        load_reward([path])(["1", "2"], ["1", "2"], ["a", "b"])
    assert f"task.rewards.functions[0]={path!r}" in str(info.value)


def test_reward_weights_must_match_and_be_finite() -> None:
    with pytest.raises(ValueError, match=r"task\.rewards\.weights"):
        load_reward(["microrl.tasks.rewards:exact_match"], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"task\.rewards\.weights\[0\]"):
        load_reward(["microrl.tasks.rewards:exact_match"], [math.inf])
    with pytest.raises(ValueError, match=r"task\.rewards"):
        load_reward([])


def test_rewards_replace_a_built_in_tasks_reward() -> None:
    cfg = TaskConfig(
        max_operand=9,
        eval_size=8,
        rewards=RewardsConfig(functions=["microrl.tasks.rewards:numeric_match"]),
    )
    task = make_task(cfg)
    assert isinstance(task, RewardedTask) and task.toy_alphabet == AdditionTask.toy_alphabet
    problem = AdditionTask.make(3, 4)
    assert task.score(["7 it is"], [problem]) == [1.0]  # exact match would give 0
    assert task.eval_problems() == AdditionTask(9, 8, 0).eval_problems()


# ----------------------------------------------------------------------------- word problems
def test_word_problems_are_deterministic_held_out_and_scored_by_the_last_number() -> None:
    task = make_task(TaskConfig(name="word_problems", max_operand=20, eval_size=50, seed=3))
    assert isinstance(task, WordProblemTask) and isinstance(task, Task)
    again = WordProblemTask(20, 50, 3)
    assert task.eval_problems() == again.eval_problems()
    assert task.sample(random.Random(1), 20) == again.sample(random.Random(1), 20)
    assert task.eval_problems() != WordProblemTask(20, 50, 4).eval_problems()
    held_out = {p.prompt for p in task.eval_problems()}
    train = task.sample(random.Random(0), 3000)
    assert len(held_out) == 50 and not held_out & {p.prompt for p in train}
    for p in train[:200]:
        a, b = (int(w.rstrip(".")) for w in p.prompt.split() if w.rstrip(".").isdigit())
        want = a + b if "more" in p.prompt else a - b if "away" in p.prompt else a * b
        assert p.answer == str(want) and int(p.answer) >= 0
        assert set(p.prompt + p.answer) <= set(WORD_ALPHABET)
    p = train[0]
    assert task.score([p.answer, f"{p.answer} {p.prompt.split()[3]}", "9999", ""], [p] * 4) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    # The toy tokenizer built for it writes every prompt; the addition model's cannot.
    tokenizer = build_tokenizer(task.toy_alphabet)
    ids = tokenizer([q.prompt for q in task.eval_problems()])["input_ids"]
    assert tokenizer.unk_token_id not in {i for row in ids for i in row}
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == task.eval_problems()[0].prompt
    cfg = TaskConfig(name="word_problems", max_operand=20, eval_size=50)
    with pytest.raises(ValueError, match=r"model\.path"):
        make_task(cfg, build_tokenizer())
    with pytest.raises(ValueError, match=r"task\.eval_size"):
        WordProblemTask(2, 10_000)


def test_a_tokenizer_that_does_not_give_its_prompts_back_is_an_error(tmp_path: Path) -> None:
    # transformers 5 loads the toy tokenizer saved beside a Qwen2 config.json as its own
    # Qwen2Tokenizer, which drops the spaces: no token is unknown, but the text is not the same.
    from transformers import Qwen2Config

    from microrl.run.toy_model import load_tokenizer

    cfg = TaskConfig(name="word_problems", max_operand=20, eval_size=50)
    tokenizer = build_tokenizer(make_task(cfg).toy_alphabet)
    make_task(cfg, tokenizer)  # the tokenizer as built writes every prompt back
    tokenizer.save_pretrained(tmp_path)
    size = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    Qwen2Config(vocab_size=len(tokenizer), num_hidden_layers=1, **size).save_pretrained(tmp_path)
    swapped = load_tokenizer(tmp_path)
    message = (
        rf"model\.path='{re.escape(str(tmp_path))}' \({type(swapped).__name__}\).*comes back as"
    )
    with pytest.raises(ValueError, match=message):
        make_task(cfg, swapped)
    # The addition prompts have no spaces: that tokenizer writes them as they are.
    make_task(TaskConfig(), swapped)


def test_no_warm_start_for_a_dataset_task(tmp_path: Path) -> None:
    from microrl.run.base_model import prepare_base_model

    cfg = TaskConfig(
        name="dataset",
        eval_size=1,
        dataset=DatasetConfig(
            train_file=str(_jsonl(tmp_path / "t.jsonl", [{"prompt": "1", "answer": "1"}] * 3))
        ),
        rewards=RewardsConfig(functions=["microrl.tasks.rewards:exact_match"]),
    )
    with pytest.raises(ValueError, match=r"model\.path=.*give model\.path a local checkpoint"):
        prepare_base_model(ModelConfig(path=str(tmp_path / "empty"), build_toy=True), cfg, None, 4)


@pytest.mark.slow
def test_the_grpo_recipe_trains_on_word_problems(tmp_path: Path) -> None:
    """``task.name=word_problems`` end to end: a toy base model built for its alphabet, then RL."""
    from example_utils import TINY_MODEL, TINY_RL, load_example

    from microrl.run import read_metrics
    from microrl.run.toy_model import load_pretrained

    base, out = tmp_path / "base", tmp_path / "out"
    args = [
        *TINY_MODEL,
        *TINY_RL,
        "task.name=word_problems",
        "model.max_positions=80",
        f"model.path={base}",
        f"output.dir={out}",
        "output.tensorboard=false",
        "output.plot=false",
        "train.steps=2",
    ]
    assert load_example("grpo_lora").main(args) == 0
    tokenizer, _ = load_pretrained(base)
    assert "a" in tokenizer.get_vocab() and "?" in tokenizer.get_vocab()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    # A prompt longer than the toy model's positions is refused before it is built.
    short = [a for a in args if not a.startswith(("model.path=", "output.dir="))]
    with pytest.raises(ValueError, match=r"model\.max_positions must be >= "):
        load_example("grpo_lora").main(
            [
                *short,
                "model.max_positions=32",
                f"model.path={tmp_path / 'b2'}",
                f"output.dir={tmp_path / 'o2'}",
            ]
        )
