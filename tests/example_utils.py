"""Config overrides that shrink the example recipes to a few seconds, for their tests."""

# Tiny everything: a 1-layer model, a 2-step warm start, 2-4 RL steps of 8 rows.
TINY_MODEL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.build_toy=true",  # a toy base model at the test's own model.path
    "model.warm_start.max_steps=2",
    "model.warm_start.eval_every=2",
    "model.warm_start.batch_size=16",
    "task.max_operand=9",
    "task.eval_size=8",
    "output.progress=false",
]
TINY_RL = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "train.mini_batch_size=4",
    "train.ppo_epochs=1",
    "train.eval_every=2",
    "actor.micro_batch_size=2",
]


def load_example(name: str):
    """The example script ``examples/<name>.py`` as a module (its ``main``, its functions).

    Loaded from its file, as a user's copy of it would be: the scripts import only ``microrl``,
    so nothing needs to be on ``sys.path``."""
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_recipe(name: str):
    """The recipe module ``examples/<name>.py`` runs (``microrl.recipes.grpo`` for ``grpo_lora``):
    the script is a thin caller, so a test's spies replace the recipe module's names."""
    import importlib

    return importlib.import_module(f"microrl.recipes.{name.removesuffix('_lora')}")


# A reward that differs within every group from the first step on (the response's length), so
# the tiny, barely warm-started policy moves every step and a lag shows in the metrics.
LENGTH_REWARD = "def length(completions):\n    return [len(c) / 4 for c in completions]\n"


def async_run_args(root, model: list[str] = TINY_MODEL) -> list[str]:
    """The asynchronous-RL tests' runs: ``model``'s overrides, ``TINY_RL``, a base model and the
    length reward under ``root``, 4 steps, no plots."""
    (root / "length_reward.py").write_text(LENGTH_REWARD)
    return [
        *model,
        *TINY_RL,
        f"model.path={root / 'base'}",
        f"task.rewards.functions=[{root / 'length_reward.py'}:length]",
        "output.plot=false",
        "output.tensorboard=false",
        "train.steps=4",
    ]


def run_recorded(args: list[str], monkeypatch, recipe: str = "grpo_lora"):
    """Run ``recipe`` in process with ``args``: the prompts each step trained on, and its
    ``metrics.jsonl`` records; no worker process is left behind."""
    import multiprocessing
    from pathlib import Path

    from microrl.run import read_metrics, sample_rows

    module = load_example(recipe)
    trained: list[list[str]] = []

    def record(rollout, problems, scores, *rest):
        trained.append([p.prompt for p in problems])
        return sample_rows(rollout, problems, scores, *rest)

    monkeypatch.setattr(load_recipe(recipe), "sample_rows", record)
    out = next(a.split("=", 1)[1] for a in args if a.startswith("output.dir="))
    assert module.main(args) == 0
    assert not multiprocessing.active_children()  # the workers are gone
    return trained, read_metrics(Path(out) / "metrics.jsonl")
