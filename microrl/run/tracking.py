"""What a user sees: a tqdm bar with live reward/accuracy on a terminal, or one short plain line
every ``log_every`` steps in a log file (cluster jobs, ``> log``, pipes); metrics as JSON lines and
in the experiment trackers named (TensorBoard, Weights & Biases, MLflow; docs/tracking.md); a few
sampled completions every ``samples_every`` steps; and a PNG of the curves at the end. Only the
main rank writes anything.
"""

from __future__ import annotations

import html
import importlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Protocol, TextIO

from tqdm.auto import tqdm

from microrl.configs.run import TRACKER_NAMES, TRACKERS_INSTALL

__all__ = [
    "METRICS_FILE",
    "PLOT_FILE",
    "SAMPLES_FILE",
    "TRACKER_RUNS_FILE",
    "Tracker",
    "mean_metrics",
    "plot_metrics",
    "read_metrics",
]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
SAMPLES_FILE = "samples.jsonl"  # the completions of Tracker.log_samples, one JSON line per row
# The W&B and MLflow run ids of the run in output.dir: --resume continues those runs.
TRACKER_RUNS_FILE = "trackers.json"
# The curves worth a panel each, in reading order; absent keys are skipped.
PLOT_PANELS: tuple[tuple[str, ...], ...] = (
    ("reward", "eval/accuracy"),
    ("loss",),
    ("kl",),
    ("entropy",),
    ("clipfrac",),
    ("grad_norm",),
    ("critic/vf_loss",),
    ("tokens_per_s",),
)
# Shown on the progress bar, in this order, when present.
BAR_KEYS = ("reward", "eval/accuracy", "kl", "loss")
# Shown on a plain log line, in this order, when present: (metric, label, format). All but the
# accuracy (the last evaluation) are means over the steps since the previous line.
LINE_KEYS = (
    ("reward", "reward", ".3f"),
    ("eval/accuracy", "accuracy", ".3f"),
    ("kl", "kl", ".3g"),
    ("loss", "loss", ".3g"),
    ("tokens_per_s", "tokens/s", ".0f"),
)


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Tracker:
    """Per-step metrics sink. ``enabled=False`` (non-main ranks) makes every method a no-op.

    Progress goes to ``stream`` (stdout): a live bar when it is a terminal and ``progress`` is
    on; otherwise one plain line every ``log_every`` steps and at the last step (``0``: none),
    short enough for any log viewer.

    Every record also goes to each of ``trackers`` (``tensorboard``, ``wandb``, ``mlflow``);
    W&B and MLflow get ``config`` (a nested dict: W&B's run config, MLflow's params under
    flattened ``a.b`` keys) at the start, ``curves.png`` at :meth:`close`, and run in ``project``
    (W&B project, MLflow experiment) under the name of ``out_dir``. ``tensorboard=False`` leaves
    TensorBoard out whatever ``trackers`` says (the switch from before ``trackers``).

    :meth:`log_samples` shows what the model writes: every ``samples_every`` steps and at the
    last (``0``: never), ``samples_per_step`` rows go to ``samples.jsonl`` and to each tracker as a
    table.

    On resume (``start_step > 0``) the JSONL lines of steps after ``start_step`` are dropped: they
    belong to the interrupted run's unsaved tail and would otherwise appear twice. A fresh run
    (``start_step == 0``) starts the files empty. The W&B and MLflow runs are continued on resume
    (their ids are kept in ``out_dir/trackers.json``); a fresh run opens new ones.

    Raises:
        ValueError: an unknown tracker name.
        ImportError: a tracker's library is not installed (the message gives the install command).
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        trackers: Iterable[str] = ("tensorboard",),
        tensorboard: bool = True,
        config: Mapping[str, Any] | None = None,
        project: str = "microrl",
        progress: bool = True,
        log_every: int = 10,
        samples_every: int = 0,
        samples_per_step: int = 4,
        stream: TextIO | None = None,
    ) -> None:
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.metrics_path = self.out_dir / METRICS_FILE
        self.samples_path = self.out_dir / SAMPLES_FILE
        self._samples_every = samples_every
        self._samples_per_step = samples_per_step
        self._bar = None
        self._backends: dict[str, _Backend] = {}
        self.locations: list[str] = []  # where the trackers write: tensorboard/, a W&B URL, ...
        self._last_step = start_step
        self._last_eval: float | None = None
        self._last_kl: float | None = None  # measured only every train.kl_metric_every steps
        self._stream = stream if stream is not None else sys.stdout
        self._total = total_steps
        self._start_step = start_step
        self._t0 = time.perf_counter()
        self._window: list[Mapping[str, float | None]] = []
        self._log_every = 0
        names = [n for n in dict.fromkeys(trackers) if tensorboard or n != "tensorboard"]
        unknown = [n for n in names if n not in _BACKENDS]
        if unknown:
            raise ValueError(
                f"output.trackers: unknown tracker {', '.join(unknown)}; known: "
                f"{', '.join(_BACKENDS)}"
            )
        if not enabled:
            return
        for name in names:  # every library first: a missing one fails before anything is opened
            _BACKENDS[name].load()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        kept = [m for m in read_metrics(self.metrics_path) if m.get("step", 0) <= start_step]
        kept = kept if start_step > 0 else []
        self.metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        if self.samples_path.exists():  # created by the first log_samples, kept like the metrics
            kept = [r for r in read_metrics(self.samples_path) if r["step"] <= start_step]
            kept = kept if start_step > 0 else []
            self.samples_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._open_backends(names, start_step, config or {}, project)
        if progress and _is_terminal(self._stream):
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                file=self._stream,
                dynamic_ncols=True,
            )
        else:
            self._log_every = log_every

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` of ``step`` (1-based); non-finite values are written as null."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        for backend in self._backends.values():
            backend.log(step, values)
        self._last_step = step
        if "eval/accuracy" in record and record["eval/accuracy"] is not None:
            self._last_eval = record["eval/accuracy"]
        if record.get("kl") is not None:
            self._last_kl = record["kl"]
        if self._bar is not None:
            # The last eval and the last KL measured, on every step.
            latest = {**record, "eval/accuracy": self._last_eval, "kl": self._last_kl}
            shown = {k: latest[k] for k in BAR_KEYS if latest.get(k) is not None}
            self._bar.set_postfix(
                {k.removeprefix("eval/"): f"{v:.3g}" for k, v in shown.items()}, refresh=False
            )
            self._bar.update(step - self._bar.n)
        elif self._log_every and step > self._start_step:  # not the starting evaluation
            self._window.append(record)
            if step % self._log_every == 0 or step == self._total:
                print(self._line(step), file=self._stream, flush=True)
                self._window = []

    def log_samples(self, step: int, rows: Iterable[Mapping[str, Any]]) -> None:
        """Record the first ``samples_per_step`` of ``rows`` (e.g. ``prompt``, ``response``,
        ``reward``, ``group``) when ``step`` is due: a multiple of ``samples_every`` or the last.

        ``rows`` is read only on those steps (a generator costs nothing on the others). Each row
        is a line of ``samples.jsonl`` with ``step`` first, and a row of the trackers' table
        (TensorBoard: a Markdown table under the tag ``samples``; W&B: a ``wandb.Table``;
        MLflow: the artifact ``samples/step_<step>.json``).
        """
        every = self._samples_every
        if not (self.enabled and every and (step % every == 0 or step == self._total)):
            return
        records = [
            {"step": step, **{k: _json_value(v) for k, v in row.items()}}
            for row in islice(rows, self._samples_per_step)
        ]
        if not records:
            return
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        table = [{k: v for k, v in r.items() if k != "step"} for r in records]
        for backend in self._backends.values():
            backend.log_samples(step, table)

    def _open_backends(
        self, names: list[str], start_step: int, config: Mapping[str, Any], project: str
    ) -> None:
        """Open each tracker, continuing on resume the runs whose ids ``trackers.json`` holds."""
        runs_path = self.out_dir / TRACKER_RUNS_FILE
        run_ids = (
            json.loads(runs_path.read_text()) if start_step > 0 and runs_path.is_file() else {}
        )
        for name in names:
            start = _Start(self.out_dir, start_step, run_ids.get(name), config, project)
            self._backends[name] = backend = _BACKENDS[name](start)
            if backend.run_id is not None:
                run_ids[name] = backend.run_id
        if run_ids:
            runs_path.write_text(json.dumps(run_ids, indent=1) + "\n")
        elif runs_path.exists():  # a previous run's, on a fresh start: never to be continued
            runs_path.unlink()
        self.locations = [backend.location for backend in self._backends.values()]

    def _line(self, step: int) -> str:
        """``step 20/300  0:00:16 (eta 0:03:44)  reward 0.41  accuracy 0.658  kl 0.25 ...``"""
        elapsed = time.perf_counter() - self._t0
        done = step - self._start_step
        eta = elapsed / done * (self._total - step) if done > 0 else 0.0
        width = len(str(self._total))
        parts = [f"step {step:>{width}}/{self._total}  {_clock(elapsed)} (eta {_clock(eta)})"]
        for key, label, fmt in LINE_KEYS:
            if key == "eval/accuracy":
                value = self._last_eval
            else:
                values = [r[key] for r in self._window if r.get(key) is not None]
                value = sum(values) / len(values) if values else None
            if value is not None:
                parts.append(f"{label} {value:{fmt}}")
        return "  ".join(parts)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.enabled:
            tqdm.write(message, file=self._stream)
            self._stream.flush()

    def close(self, *, plot: bool = True) -> Path | None:
        """Flush everything; returns the plot's path when one was drawn."""
        if not self.enabled:
            return None
        if self._bar is not None:
            self._bar.close()
        png = plot_metrics(self.metrics_path, self.out_dir / PLOT_FILE) if plot else None
        for backend in self._backends.values():
            if png is not None:
                backend.log_image(png, self._last_step)
            backend.close()
        self._backends = {}
        return png


# ----------------------------------------------------------------------------- trackers
@dataclass(frozen=True)
class _Start:
    """What a tracker is opened with."""

    out_dir: Path
    start_step: int
    run_id: str | None  # the run to continue (resume), or None for a new one
    config: Mapping[str, Any]
    project: str


class _Backend(Protocol):
    run_id: str | None  # None: nothing to continue on resume (TensorBoard: the directory is it)
    location: str

    @staticmethod
    def load() -> Any: ...
    def log(self, step: int, values: Mapping[str, float]) -> None: ...
    def log_image(self, path: Path, step: int) -> None: ...
    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


def _import_tracker(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"output.trackers names {module}, which is not installed: {TRACKERS_INSTALL}"
        ) from err


class _TensorBoard:
    """Scalars under ``out_dir/tensorboard``; a resumed run drops the events after its step."""

    run_id = None
    location = "tensorboard/"

    @staticmethod
    def load() -> Any:
        from torch.utils.tensorboard import SummaryWriter  # a dependency of microrl

        return SummaryWriter

    def __init__(self, start: _Start) -> None:
        self._writer = self.load()(
            log_dir=str(start.out_dir / "tensorboard"), purge_step=start.start_step + 1
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def log_image(self, path: Path, step: int) -> None:
        pass  # TensorBoard draws the curves itself

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._writer.add_text("samples", _markdown_table(rows), step)

    def close(self) -> None:
        self._writer.close()


class _WandB:
    """A W&B run; ``WANDB_MODE`` (online, offline, disabled) and the other ``WANDB_*``
    variables apply as usual; its local files go to ``out_dir/wandb`` unless ``WANDB_DIR`` is set.
    """

    @staticmethod
    def load() -> Any:
        return _import_tracker("wandb")

    def __init__(self, start: _Start) -> None:
        self._wandb = self.load()
        self._run = self._wandb.init(
            project=start.project,
            name=start.out_dir.name,
            config=dict(start.config),
            id=start.run_id,
            resume="allow" if start.run_id else None,
            dir=None if os.environ.get("WANDB_DIR") else str(start.out_dir),
        )
        self.run_id: str | None = self._run.id
        self.location = (
            "W&B (WANDB_MODE=disabled)"
            if self._run.disabled
            else self._run.url or f"W&B run {self._run.id} ({Path(self._run.dir).parent})"
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        # A resumed online run ignores steps it already has (an unsaved tail logged before a kill).
        self._run.log(dict(values), step=step)

    def log_image(self, path: Path, step: int) -> None:
        self._run.log({"curves": self._wandb.Image(str(path))}, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = _columns(rows)
        self._run.log({"samples": self._wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self._run.finish()


class _MLflow:
    """An MLflow run at ``MLFLOW_TRACKING_URI``, else in a file store at ``out_dir/mlruns``."""

    @staticmethod
    def load() -> Any:
        return _import_tracker("mlflow")

    def __init__(self, start: _Start) -> None:
        self._mlflow = mlflow = self.load()
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 opens a file store only when asked to (it prefers a database, which needs
            # the full mlflow package); a local store beside the run needs nothing more.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((start.out_dir / "mlruns").resolve().as_uri())
        if start.run_id is None:
            mlflow.set_experiment(start.project)
            run = mlflow.start_run(run_name=start.out_dir.name)
        else:
            run = mlflow.start_run(run_id=start.run_id)
        self.run_id: str | None = run.info.run_id
        self.location = f"MLflow run {run.info.run_id} ({mlflow.get_tracking_uri()})"
        # Params cannot change once logged: a resumed run adds only new keys; the artifact
        # config.yaml is the latest config.
        params = {k: v for k, v in _flat_params(start.config).items() if k not in run.data.params}
        if params:
            mlflow.log_params(params)
        if start.config:
            mlflow.log_dict(dict(start.config), "config.yaml")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._mlflow.log_metrics(dict(values), step=step)

    def log_image(self, path: Path, step: int) -> None:
        self._mlflow.log_artifact(str(path))

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        # mlflow.log_table's layout, without the pandas it needs (not in mlflow-skinny).
        columns, data = _columns(rows)
        self._mlflow.log_dict({"columns": columns, "data": data}, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._mlflow.end_run()


def _columns(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Column names (every key, in first-seen order) and a list of values per row."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return columns, [[row.get(k) for k in columns] for row in rows]


# Markdown's punctuation, backslash-escaped in a text cell so that it shows as written.
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+\-.!|])")


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (TensorBoard's text tab) showing the text as the model wrote
    it: HTML (``<think>``, which TensorBoard would drop) and Markdown escaped, newlines as
    ``<br>``."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        text = html.escape("" if value is None else str(value), quote=False)
        return _MARKDOWN_PUNCTUATION.sub(r"\\\1", text).replace("\n", "<br>")

    columns, data = _columns(rows)
    lines = [columns, ["---"] * len(columns), *([cell(v) for v in row] for row in data)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def _flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"steps": 300}}`` -> ``{"train.steps": "300"}``; values as JSON (``null``)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flat_params(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value if isinstance(value, str) else json.dumps(value)
    return out


_BACKENDS: dict[str, type[_Backend]] = {
    "tensorboard": _TensorBoard,
    "wandb": _WandB,
    "mlflow": _MLflow,
}
assert tuple(_BACKENDS) == TRACKER_NAMES  # the config's names (output.trackers) are these


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _json_value(value: Any) -> Any:
    """A sample's value for JSON: strings and ints as they are, other numbers (a tensor's
    scalar) as floats, non-finite ones as null."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    return _finite_or_none(value)


def plot_metrics(metrics_path: str | Path, png_path: str | Path) -> Path:
    """One panel per curve of :data:`PLOT_PANELS` found in the JSONL; written with the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed, also under torchrun
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    panels = [keys for keys in PLOT_PANELS if any(k in r for r in records for k in keys)]
    cols = min(4, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, keys in zip(axes.flat, panels, strict=False):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 20 else None, markersize=3, label=key)
        ax.set_title(" / ".join(keys))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


# Engine metric names -> the names the examples report (the rest keep their own name).
RENAMED = {"pg_clipfrac": "clipfrac"}


def mean_metrics(updates: list[dict[str, float]], prefix: str = "") -> dict[str, float]:
    """Average the metrics of a step's optimizer updates (loss, kl, clipfrac, grad_norm, ...).

    NaN means "no value" (e.g. ``ratio_min`` of a mini-batch without loss tokens): it is left out
    of the average; a metric without any value in the step stays NaN (logged as null).
    """
    if not updates:
        return {}
    keys = [k for k in updates[0] if all(k in u for u in updates)]
    return {prefix + RENAMED.get(k, k): _nan_mean([u[k] for u in updates]) for k in keys}


def _nan_mean(values: list[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return sum(present) / len(present) if present else math.nan
