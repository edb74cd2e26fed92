"""Reward functions given by import path, called on a batch of completions (docs/tasks.md).

A reward function scores a batch of completions against their reference answers::

    def score(completions: list[str], answers: list[str], prompts: list[str], **kwargs):
        ...  # one finite float per completion, in order

``completions`` are the decoded response texts (special tokens removed), ``answers`` the
reference answers of the rows (as text) and ``prompts`` the prompts that were sampled from (after
any chat template). As in TRL, the other columns of a dataset row come as keyword arguments
named after them, one value per completion (``answer=[...]``, ``difficulty=[...]``; the prompt's
column is ``prompts``). A function gets the keywords it declares, or all with ``**kwargs``, so
``def score(completions, answers)`` is enough, and TRL's ``def reward(prompts, completions,
**kwargs)`` works as is. ``completions`` is passed by keyword when the function has a parameter of
that name, else as the first argument. The function may return a list, a tuple, a 1-d numpy
array or tensor; an exception it raises comes out as a :class:`RewardError` naming it.

A config names each function as ``module:function`` (``module`` importable from an installed
package or from the working directory) or ``path/to/file.py:function`` (relative to the working
directory); several functions are summed with weights (:func:`load_reward`). Built-in functions
usable the same way: ``microrl.tasks.rewards:exact_match`` and ``microrl.tasks.rewards:numeric_match``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from microrl.tasks.base import Problem, Task, answers_for

__all__ = [
    "Reward",
    "RewardError",
    "RewardFn",
    "RewardedTask",
    "exact_match",
    "load_reward",
    "numeric_match",
    "parse_number",
    "resolve_reward_fn",
    "score_problems",
]

RewardFn = Callable[..., Sequence[float]]

# The keywords every call offers; a dataset column of one of these names is not passed.
_GIVEN = ("completions", "answers", "prompts")


class RewardError(RuntimeError):
    """A reward function raised: the message names its config entry and the original error (the
    ``__cause__``)."""


# A number as people write it: optional sign, digits with optional thousands commas, optional
# decimals ("1,234.5", "-7", "3.").
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def parse_number(text: str) -> float | None:
    """The last number written in ``text`` (``"so 3 + 4 = 7."`` -> 7.0), or None if there is none."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def exact_match(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, is exactly the answer."""
    return [
        1.0 if c.strip() == str(a).strip() else 0.0
        for c, a in zip(completions, answers, strict=True)
    ]


def numeric_match(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 where the last number in the completion equals the answer's number, else 0.0."""
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        got, want = parse_number(completion), parse_number(str(answer))
        scores.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return scores


def _load_file_module(file: Path, key: str, spec_text: str):
    name = f"_microrl_reward_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{key}={spec_text!r}: cannot load {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_module(module_name: str, key: str, spec_text: str):
    def is_this_module(err: ModuleNotFoundError) -> bool:  # not a missing import inside it
        return bool(err.name) and (
            module_name == err.name or module_name.startswith(err.name + ".")
        )

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if not is_this_module(err):
            raise
    # `python script.py` puts the script's directory on sys.path, not the working directory:
    # look there too (appended, so it never shadows an installed package).
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if not is_this_module(err):
                raise
    raise ValueError(
        f"{key}={spec_text!r}: no module named {module_name!r} (neither installed nor in the "
        f"working directory {cwd})"
    )


def resolve_reward_fn(spec_text: str, key: str = "task.rewards.functions") -> RewardFn:
    """The function an import path names: ``module:function`` or ``path/to/file.py:function``.

    Raises ``ValueError`` (malformed path, missing module, file or function) or ``TypeError``
    (not callable, or no parameter for the completions); every message names ``key``.
    """
    if not isinstance(spec_text, str) or spec_text.count(":") < 1:
        raise ValueError(
            f"{key}={spec_text!r} must be 'module:function' or 'path/to/file.py:function'"
        )
    target, _, fn_name = spec_text.rpartition(":")
    if not target or not fn_name.isidentifier():
        raise ValueError(
            f"{key}={spec_text!r} must be 'module:function' or 'path/to/file.py:function'"
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        file = Path(target).expanduser()
        if not file.is_file():
            raise ValueError(f"{key}={spec_text!r}: file {str(file)!r} does not exist")
        module = _load_file_module(file, key, spec_text)
    else:
        module = _import_module(target, key, spec_text)
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ValueError(f"{key}={spec_text!r}: {target!r} has no attribute {fn_name!r}")
    if not callable(fn):
        raise TypeError(f"{key}={spec_text!r}: {fn_name!r} is a {type(fn).__name__}, not callable")
    return fn


@dataclass(frozen=True)
class _Signature:
    """How a reward function is called: which keywords it takes."""

    completions_by_keyword: bool  # a parameter named "completions"
    any_keyword: bool  # **kwargs
    names: frozenset[str]  # the parameters a keyword can fill
    required: frozenset[str]  # those without a default (the completions aside)

    @classmethod
    def of(cls, fn: RewardFn, key: str, spec_text: str) -> _Signature:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature: answers and prompts
            return cls(False, False, frozenset({"answers", "prompts"}), frozenset())
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        by_keyword = "completions" in names
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not (by_keyword or positional or any(p.kind is p.VAR_POSITIONAL for p in params)):
            raise TypeError(
                f"{key}={spec_text!r}: a reward function takes the completions as its first "
                "argument: fn(completions, answers, prompts) -> list[float]"
            )
        first = None if by_keyword or not positional else positional[0].name
        required = {
            p.name
            for p in params
            if p.name in names and p.default is p.empty and p.name not in ("completions", first)
        }
        return cls(
            by_keyword,
            any(p.kind is p.VAR_KEYWORD for p in params),
            frozenset(names - {"completions", first}),
            frozenset(required),
        )


@dataclass(frozen=True)
class _Term:
    fn: RewardFn
    weight: float
    path: str
    signature: _Signature
    key: str

    def __call__(self, completions: list[str], given: dict[str, list]) -> object:
        sig = self.signature
        kwargs = {k: v for k, v in given.items() if sig.any_keyword or k in sig.names}
        missing = sorted(sig.required - set(kwargs))
        if missing:
            columns = [k for k in given if k not in _GIVEN]
            raise ValueError(
                f"{self.key}={self.path!r} takes {', '.join(map(repr, missing))}, which is "
                "neither answers, prompts nor a column of the rows (their other columns: "
                f"{', '.join(columns) or 'none'})"
            )
        try:
            if sig.completions_by_keyword:
                return self.fn(completions=completions, **kwargs)
            return self.fn(completions, **kwargs)
        except Exception as err:
            message = str(err).strip().splitlines()
            raise RewardError(
                f"{self.key}={self.path!r} raised {type(err).__name__}"
                + (f": {message[0]}" if message else "")
            ) from err


class Reward:
    """The weighted sum of reward functions, called on a batch of completions.

    ``reward(completions, answers, prompts, **columns)`` calls each function once on the whole
    batch (with the keywords it takes: ``answers``, ``prompts`` and the rows' other ``columns``,
    one value per completion each) and returns ``sum_i weight_i * fn_i(...)`` per row; a function
    that raises (:class:`RewardError`) or returns the wrong number of values, a non-number or a
    non-finite value is an error naming its config key.
    """

    def __init__(
        self,
        fns: Sequence[RewardFn | str],
        weights: Sequence[float] = (),
        key: str = "task.rewards.functions",
        weights_key: str = "task.rewards.weights",
    ) -> None:
        if not fns:
            raise ValueError(f"{key} must name at least one reward function, got []")
        if weights and len(weights) != len(fns):
            raise ValueError(
                f"{weights_key} must have one weight per entry of {key} ({len(fns)}), "
                f"got {list(weights)!r}"
            )
        weights = list(weights) or [1.0] * len(fns)
        self.terms: list[_Term] = []
        for i, (fn, weight) in enumerate(zip(fns, weights, strict=True)):
            if not math.isfinite(weight):
                raise ValueError(f"{weights_key}[{i}] must be finite, got {weight!r}")
            # A model-based term (reward model, judge) is named by its own config key.
            term_key = getattr(fn, "config_key", None) or f"{key}[{i}]"
            path = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
            fn = resolve_reward_fn(fn, term_key) if isinstance(fn, str) else fn
            signature = _Signature.of(fn, term_key, path)
            self.terms.append(_Term(fn, float(weight), path, signature, term_key))

    def __call__(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        prompts: Sequence[str],
        **columns: Sequence[object],
    ) -> list[float]:
        n = len(completions)
        lengths = [len(answers), len(prompts), *(len(v) for v in columns.values())]
        if any(length != n for length in lengths):
            raise ValueError(
                f"got {n} completions for {len(answers)} answers, {len(prompts)} prompts and "
                f"columns of {sorted({len(v) for v in columns.values()})} values"
            )
        totals = [0.0] * n
        given = {k: list(v) for k, v in columns.items() if k not in _GIVEN}
        given.update(answers=list(answers), prompts=list(prompts))
        for term in self.terms:
            values = _check_values(term(list(completions), given), n, term)
            totals = [t + term.weight * v for t, v in zip(totals, values, strict=True)]
        return totals

    @property
    def model_based(self) -> bool:
        """Whether a term is a model (a reward model, an LLM judge: slow, scored ahead in an
        asynchronous run)."""
        return any(hasattr(term.fn, "drain_metrics") for term in self.terms)

    @property
    def collective(self) -> bool:
        """Whether a term scores collectively (a reward model sharded under ``torchrun``): every
        rank must then call this reward in the same order, on its trainer thread."""
        return any(getattr(term.fn, "collective", False) for term in self.terms)

    def drain_metrics(self) -> dict[str, float]:
        """The counters of the model-based terms (``judge/*``, ``reward_model/*``) since the
        last call; {} when there are none."""
        metrics: dict[str, float] = {}
        for term in self.terms:
            drain = getattr(term.fn, "drain_metrics", None)
            if drain is not None:
                metrics.update(drain())
        return metrics


def _check_values(values: object, n: int, term: _Term) -> list[float]:
    where = f"{term.key}={term.path!r}"
    if hasattr(values, "tolist"):  # numpy arrays, tensors
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise TypeError(
            f"{where} returned a {type(values).__name__}: a reward function returns one float "
            f"per completion (a list of {n})"
        )
    if len(values) != n:
        raise ValueError(f"{where} returned {len(values)} values for {n} completions")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(
                f"{where} returned {v!r} (a {type(v).__name__}) for row {i}, not a float"
            )
        if not math.isfinite(v):
            raise ValueError(f"{where} returned the non-finite value {v!r} for row {i}")
        out.append(float(v))
    return out


def load_reward(
    paths: Sequence[str],
    weights: Sequence[float] = (),
    key: str = "task.rewards.functions",
    weights_key: str = "task.rewards.weights",
) -> Reward:
    """A :class:`Reward` from import paths (``module:function``, ``file.py:function``) and weights
    (empty: 1.0 each)."""
    return Reward(list(paths), list(weights), key, weights_key)


class RewardedTask:
    """A task's prompts scored by another reward (a built-in task with ``task.rewards.functions`` given)."""

    def __init__(self, task: Task, reward: Reward, solved_threshold: float) -> None:
        self.task = task
        self.reward = reward
        self.solved_threshold = solved_threshold

    def __getattr__(self, name: str):  # toy_alphabet, max_answer_chars, ...
        if name == "task":
            raise AttributeError(name)
        return getattr(self.task, name)

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return self.task.sample(rng, n)

    def eval_problems(self) -> list[Problem]:
        return self.task.eval_problems()

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        return score_problems(self.reward, responses, problems)


def score_problems(
    reward: Reward, responses: Sequence[str], problems: Sequence[Problem]
) -> list[float]:
    """``reward`` on ``responses`` to ``problems``: their answers, prompts and columns."""
    answers = answers_for(responses, problems)
    names = dict.fromkeys(name for p in problems for name in p.columns)
    columns = {name: [p.columns.get(name) for p in problems] for name in names}
    return reward(responses, answers, [p.prompt for p in problems], **columns)
