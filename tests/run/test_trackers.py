"""Experiment trackers (``output.trackers``; microrl/run/tracking.py, docs/tracking.md).

- W&B (offline) and MLflow (a file store) get the config at the start, every metric of every
  step, and ``curves.png`` at the end; what they wrote is read back from disk;
- a resumed run (``start_step > 0``) continues the same W&B / MLflow run at the later steps; a
  fresh one opens a new run;
- only the main rank opens them; ``output.tensorboard=false`` still turns TensorBoard off;
- an unknown name, or a tracker whose library is missing, is an error before anything is built
  (the latter naming the extra to install);
- end to end: ``examples/grpo_lora.py`` then ``--resume`` log to the same runs.

No network: W&B runs with ``WANDB_MODE=offline``, MLflow with its file store under the run.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import time
from pathlib import Path

import mlflow  # the trackers extra: part of the test install
import pytest
from example_utils import TINY_MODEL, TINY_RL, load_example

from microrl.configs.examples import GRPOExampleConfig
from microrl.configs.loader import load_config
from microrl.configs.run import TRACKERS_INSTALL
from microrl.run import Tracker, parse_cli
from microrl.run.tracking import TRACKER_RUNS_FILE

CONFIG = {"train": {"steps": 6, "seed": 0}, "actor": {"optim": {"lr": 1e-3, "betas": [0.9, 0.99]}}}


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B offline and quiet, its caches in tmp; MLflow at its default (the run's file store)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's stdout alone
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)  # and restored after the test


def _metrics(step: int) -> dict[str, float]:
    metrics = {"reward": 0.1 * step, "loss": -0.5, "kl": float("nan")}  # nan: not logged
    if step % 2 == 0:
        metrics["eval/accuracy"] = 0.25 + 0.05 * step
    return metrics


def _train(out: Path, trackers: list[str], start_step: int, end_step: int, **kwargs) -> Tracker:
    """The tracking of a run from ``start_step`` (0: fresh, with the step-0 evaluation) to
    ``end_step``, as :mod:`microrl.run.session` drives it."""
    tracker = Tracker(
        out,
        total_steps=end_step,
        start_step=start_step,
        trackers=trackers,
        config=CONFIG,
        progress=False,
        log_every=0,
        **kwargs,
    )
    if start_step == 0:
        tracker.log(0, {"eval/accuracy": 0.2})
    for step in range(start_step + 1, end_step + 1):
        tracker.log(step, _metrics(step))
    assert tracker.close(plot=True) == (out / "curves.png" if tracker.enabled else None)
    return tracker


# ----------------------------------------------------------------------------- W&B
def _wandb_records(path: Path):
    """The protobuf records of an offline run's ``.wandb`` file (a LevelDB-style log of 32 KiB
    blocks, each record split into chunks with a 7-byte header: crc, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _wandb_runs(out: Path, count: int) -> list[dict]:
    """The ``count`` offline runs under ``out/wandb`` in the order they started: id, project,
    config, history rows (``_step`` and the logged keys; an image's fields as ``key/field``).

    W&B's service process may write a run's file a moment after ``finish()`` returns: wait for
    each file's ``exit`` record."""
    deadline = time.monotonic() + 30
    while True:
        runs = [_wandb_run(path) for path in out.glob("wandb/offline-run-*/run-*.wandb")]
        if (len(runs) == count and all(r["finished"] for r in runs)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(runs) == count and all(r["finished"] for r in runs), runs
    return sorted(runs, key=lambda r: r["start"])


def _wandb_run(path: Path) -> dict:
    run: dict = {"history": [], "finished": False}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"], run["project"] = record.run.run_id, record.run.project
            run["start"] = record.run.start_time.ToNanoseconds()
            run["config"] = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            run["history"].append(
                {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
            )
        elif kind == "exit":
            run["finished"] = True
    return run


def test_wandb_gets_config_metrics_and_curves_and_resume_continues_the_run(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, ["wandb"], 0, 3)
    _train(out, ["wandb"], 3, 6)  # --resume from the step-3 checkpoint

    first, resumed = _wandb_runs(out, 2)
    assert (
        first["id"] == resumed["id"] == json.loads((out / TRACKER_RUNS_FILE).read_text())["wandb"]
    )
    assert first["project"] == "microrl"
    assert {k: first["config"][k] for k in CONFIG} == CONFIG  # the nested config, as given
    for run, steps in ((first, [0, 1, 2, 3]), (resumed, [4, 5, 6])):
        rows = {row["_step"]: row for row in run["history"]}
        assert sorted(rows) == steps  # the resumed run continues at the later steps
        for step in steps[1:] if steps[0] == 0 else steps:
            expected = {k: v for k, v in _metrics(step).items() if k != "kl"}
            assert {k: rows[step][k] for k in expected} == pytest.approx(expected), step
            assert "kl" not in rows[step]
        last = rows[steps[-1]]  # the plot, logged at the last step
        assert last["curves/_type"] == "image-file"
        assert next(out.glob(f"wandb/*/files/{last['curves/path']}")).is_file()


def test_a_fresh_run_opens_a_new_tracker_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _train(out, ["wandb"], 0, 1)
    _train(out, ["wandb"], 0, 1)  # --overwrite: a new run, not the previous one continued
    first, second = _wandb_runs(out, 2)
    assert first["id"] != second["id"]
    assert json.loads((out / TRACKER_RUNS_FILE).read_text()) == {"wandb": second["id"]}


# ----------------------------------------------------------------------------- MLflow
def test_mlflow_gets_params_metrics_and_curves_and_resume_continues_the_run(tmp_path: Path):
    out = tmp_path / "run"
    _train(out, ["mlflow"], 0, 3, project="adder")
    _train(out, ["mlflow"], 3, 6, project="adder")

    client = mlflow.tracking.MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("adder")
    (run,) = client.search_runs([experiment.experiment_id])  # one run, continued
    assert run.info.run_id == json.loads((out / TRACKER_RUNS_FILE).read_text())["mlflow"]
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params == {
        "train.steps": "6",
        "train.seed": "0",
        "actor.optim.lr": "0.001",
        "actor.optim.betas": "[0.9, 0.99]",
    }
    history = {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        for key in ("reward", "loss", "eval/accuracy", "kl")
    }
    assert sorted(history["reward"]) == [1, 2, 3, 4, 5, 6]  # each step once, across both runs
    assert history["reward"] == pytest.approx({s: 0.1 * s for s in range(1, 7)})
    assert history["eval/accuracy"] == pytest.approx({0: 0.2, 2: 0.35, 4: 0.45, 6: 0.55})
    assert history["kl"] == {}  # non-finite values are not logged
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"curves.png", "config.yaml"}


# ----------------------------------------------------------------------------- samples
def test_wandb_and_mlflow_get_the_sampled_completions_as_tables(tmp_path: Path) -> None:
    out = tmp_path / "run"
    tracker = Tracker(
        out,
        total_steps=2,
        trackers=["wandb", "mlflow"],
        progress=False,
        log_every=0,
        samples_every=1,
        samples_per_step=2,
    )
    for step in (1, 2):
        tracker.log(step, _metrics(step))
        rows = [
            {"group": g, "reward": 0.5 * g, "prompt": "1+2=", "response": "3"} for g in range(3)
        ]
        tracker.log_samples(step, rows)
    tracker.close(plot=False)
    columns = ["group", "reward", "prompt", "response"]
    data = [[0, 0.0, "1+2=", "3"], [1, 0.5, "1+2=", "3"]]

    (run,) = _wandb_runs(out, 1)
    rows = {row["_step"]: row for row in run["history"]}
    for step in (1, 2):  # a wandb.Table under the key samples, beside the step's metrics
        assert rows[step]["samples/_type"] == "table-file" and "reward" in rows[step]
        table = json.loads(
            next(out.glob(f"wandb/*/files/{rows[step]['samples/path']}")).read_text()
        )
        assert table["columns"] == columns and table["data"] == data

    client = mlflow.tracking.MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    run_id = json.loads((out / TRACKER_RUNS_FILE).read_text())["mlflow"]
    artifacts = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert artifacts == {"samples/step_000001.json", "samples/step_000002.json"}
    local = client.download_artifacts(run_id, "samples/step_000002.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"columns": columns, "data": data}


# ----------------------------------------------------------------------------- ranks, names, errors
def test_only_the_main_rank_opens_trackers(tmp_path: Path, monkeypatch) -> None:
    # Not even imported: a rank without the libraries would not fail either.
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    _train(tmp_path, ["tensorboard", "wandb", "mlflow"], 0, 2, enabled=False)
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_false_still_turns_tensorboard_off(tmp_path: Path) -> None:
    tracker = _train(tmp_path / "off", ["tensorboard"], 0, 1, tensorboard=False)
    assert tracker.locations == [] and not (tmp_path / "off" / "tensorboard").exists()
    tracker = _train(tmp_path / "on", ["tensorboard"], 0, 1)
    assert tracker.locations == ["tensorboard/"] and any((tmp_path / "on/tensorboard").iterdir())


def test_an_unknown_tracker_is_an_error_listing_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"output\.trackers.*tensorboard, wandb, mlflow"):
        load_config(GRPOExampleConfig, None, ["output.trackers=[tensorboard,wandbb]"])
    with pytest.raises(ValueError, match=r"output\.trackers.*wandbb.*tensorboard, wandb, mlflow"):
        Tracker(tmp_path, total_steps=1, trackers=["wandbb"])


@pytest.mark.parametrize("missing", ["wandb", "mlflow"])
def test_a_missing_library_fails_at_startup_naming_the_extra(
    missing: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # `import <missing>` raises ImportError
    # The command line refuses it, before any model is built.
    with pytest.raises(SystemExit) as info:
        parse_cli(
            GRPOExampleConfig,
            "grpo_lora.yaml",
            "test",
            [f"output.trackers=[tensorboard,{missing}]", f"output.dir={tmp_path / 'run'}"],
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "output.trackers" in err and missing in err and TRACKERS_INSTALL in err
    # The library API too, before it writes or opens anything.
    with pytest.raises(ImportError, match=f"{missing}.*{re.escape(TRACKERS_INSTALL)}"):
        Tracker(tmp_path / "run", total_steps=1, trackers=["tensorboard", missing])
    assert TRACKERS_INSTALL == 'pip install "microrl[trackers]"'
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- end to end
def test_an_example_run_and_its_resume_log_to_the_same_runs(tmp_path: Path) -> None:
    grpo_lora = load_example("grpo_lora")
    out = tmp_path / "run"
    args = [
        *TINY_MODEL,
        *TINY_RL,
        "output.trackers=[wandb,mlflow]",
        "output.plot=false",
        f"model.path={tmp_path / 'base'}",
        "model.build_toy=true",
        f"output.dir={out}",
    ]
    assert grpo_lora.main([*args, "train.steps=2"]) == 0
    assert grpo_lora.main(["--resume", f"output.dir={out}", "train.steps=3"]) == 0

    ids = json.loads((out / TRACKER_RUNS_FILE).read_text())
    first, resumed = _wandb_runs(out, 2)
    assert first["id"] == resumed["id"] == ids["wandb"]
    assert first["config"]["train"]["steps"] == 2 and resumed["config"]["train"]["steps"] == 3
    assert [r["_step"] for r in first["history"]] == [0, 1, 2]
    assert [r["_step"] for r in resumed["history"]] == [3]
    assert "reward" in resumed["history"][0] and "grad_norm" in resumed["history"][0]

    client = mlflow.tracking.MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    steps = [m.step for m in client.get_metric_history(ids["mlflow"], "reward")]
    assert steps == [1, 2, 3]
    assert client.get_run(ids["mlflow"]).data.params["train.steps"] == "2"  # params stay
    assert not (out / "tensorboard").exists()
