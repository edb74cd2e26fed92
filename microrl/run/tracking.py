"""What a user sees: a tqdm bar with live reward/accuracy on a terminal, or one short plain line
every ``log_every`` steps in a log file (cluster jobs, ``> log``, pipes); metrics as JSON lines and
TensorBoard scalars; and a PNG of the curves at the end. Only the main rank writes anything.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from tqdm.auto import tqdm

__all__ = ["METRICS_FILE", "PLOT_FILE", "Tracker", "mean_metrics", "plot_metrics", "read_metrics"]

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
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

    On resume (``start_step > 0``) the JSONL lines of steps after ``start_step`` are dropped: they
    belong to the interrupted run's unsaved tail and would otherwise appear twice. A fresh run
    (``start_step == 0``) starts the file empty.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        tensorboard: bool = True,
        progress: bool = True,
        log_every: int = 10,
        stream: TextIO | None = None,
    ) -> None:
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.metrics_path = self.out_dir / METRICS_FILE
        self._bar = None
        self._writer = None
        self._last_eval: float | None = None
        self._stream = stream if stream is not None else sys.stdout
        self._total = total_steps
        self._start_step = start_step
        self._t0 = time.perf_counter()
        self._window: list[Mapping[str, float | None]] = []
        self._log_every = 0
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        kept = [m for m in read_metrics(self.metrics_path) if m.get("step", 0) <= start_step]
        kept = kept if start_step > 0 else []
        self.metrics_path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(
                log_dir=str(self.out_dir / "tensorboard"), purge_step=start_step + 1
            )
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
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and value is not None:
                    self._writer.add_scalar(key, value, step)
        if "eval/accuracy" in record and record["eval/accuracy"] is not None:
            self._last_eval = record["eval/accuracy"]
        if self._bar is not None:
            latest = {**record, "eval/accuracy": self._last_eval}  # the last eval, every step
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
        if self._writer is not None:
            self._writer.close()
        if plot:
            return plot_metrics(self.metrics_path, self.out_dir / PLOT_FILE)
        return None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


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
