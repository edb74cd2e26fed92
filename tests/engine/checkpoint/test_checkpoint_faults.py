"""Multi-rank checkpoints that cannot hang: a fault on one rank fails every rank, in bounded time.

Each test launches this file on 2 gloo ranks with a *scenario* name; the ranks record what each
save or load raised (type, message, notes, ``failed_ranks``, seconds) as JSON and the test asserts
on that, then checks from its own process that the previous checkpoint still loads.

* ``faults`` (under torchrun): rank 1 raises while preparing, runs out of disk inside DCP's write,
  fails writing its RNG file, fails a load's checks; rank 0 fails writing the manifest. Every rank
  must raise at once (far below the agreement timeout), the others naming the failed rank, and the
  previous checkpoint must stay complete (and the process group usable).
* ``crash`` (two plain processes: torchrun's agent would kill the surviving rank as soon as the
  other dies, which would hide what it raises): rank 1 is SIGKILLed, or hangs, inside its write;
  rank 0 must raise within the bounded time naming rank 1.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import REPO, launch, rank_env

from microrl.engine.checkpoint import agreement
from microrl.engine.checkpoint import save_load as ckpt
from microrl.engine.checkpoint.atomic_io import staging_paths

HERE = Path(__file__).resolve()
# Faults a rank *reports* must reach the others at once: the agreement timeout is long, the
# allowed time short, so passing proves nobody waited for a timeout.
REPORTED_TIMEOUT_S = 60
REPORTED_WITHIN_S = 15
# A killed rank is named after the agreement timeout (plus the side group's collective timeout
# for a rank that hangs inside DCP's collectives: about twice the timeout).
CRASH_TIMEOUT_S = 5
CRASH_WITHIN_S = {"kill": 20, "hang": 30}
SAVE_FAULTS = {  # fault -> (failing rank, what it raises, the reason the other rank must show)
    "prepare": (1, "RuntimeError", "injected fault while preparing"),
    "disk_full": (1, "OSError", "No space left on device (injected)"),
    "rng_write": (1, "PermissionError", "injected: rng file not writable"),
    "finalise": (0, "OSError", "injected: manifest not writable"),
}


# ============================================================================ pytest side


def _read(tmp_path: Path, scenario: str, rank: int) -> dict:
    return json.loads((tmp_path / f"{scenario}_rank{rank}.json").read_text())


def _assert_previous_checkpoint_loads(path: Path) -> None:
    tmp, old = staging_paths(path.absolute())
    assert not tmp.exists(), f"temporary directory {tmp} left behind"
    assert not old.exists()
    assert ckpt.is_complete_checkpoint(path)
    model = _model()
    _fill(model, 0.0)
    info = ckpt.load_checkpoint(path, model=model, rng=False)  # one rank here: DCP reshards
    assert info.step == 1 and info.world_size == 2
    assert _values(model) == [1.0]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_fault_reported_by_one_rank_fails_every_rank_at_once(tmp_path, monkeypatch):
    # The timeout through the environment: how engine.save_checkpoint users set it.
    monkeypatch.setenv(agreement.TIMEOUT_ENV, str(REPORTED_TIMEOUT_S))
    launch(2, HERE, "faults", str(tmp_path), timeout=240)
    r0, r1 = _read(tmp_path, "faults", 0), _read(tmp_path, "faults", 1)
    for fault, (failing, raised, reason) in SAVE_FAULTS.items():
        bad, good = (r0, r1)[failing][fault], (r0, r1)[1 - failing][fault]
        named = f"failed on rank(s) [{failing}]"
        assert good["error"] == "CheckpointAbortedError", (fault, good)
        assert good["failed_ranks"] == [failing], (fault, good)
        assert named in good["message"] and reason in good["message"], (fault, good)
        assert bad["error"] == raised, (fault, bad)  # the failed rank raises its own exception
        if sys.version_info >= (3, 11):  # exception notes
            assert any(named in n for n in bad["notes"]), (fault, bad)
        assert max(good["seconds"], bad["seconds"]) < REPORTED_WITHIN_S, (fault, good, bad)
        state = r0[fault]  # after rank 0 raised: it removes the temporary directory first
        assert not state["tmp_left"] and not state["old_left"], (fault, state)
        assert state["complete"] and state["step"] == 1, (fault, state)
    a, b = r0["load_check"], r1["load_check"]
    assert a["error"] == "CheckpointAbortedError" and a["failed_ranks"] == [1], a
    assert "injected fault while checking" in a["message"], a
    assert b["error"] == "RuntimeError", b
    assert max(a["seconds"], b["seconds"]) < REPORTED_WITHIN_S, (a, b)
    for r in (r0, r1):
        assert r["load_check"]["values"] == [5.0], "a failed check modified the model"
        assert r["reload"] == {"step": 1, "values": [1.0]}, r["reload"]
        assert r["recovered"] == {"step": 3, "values": [3.0]}, r["recovered"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_killed_or_hung_rank_is_named_within_the_timeout(tmp_path, fault):
    env = rank_env(2)
    env.pop(agreement.TIMEOUT_ENV, None)
    procs, logs = [], []
    try:
        for rank in (0, 1):
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 (closed in the finally below)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE), "crash", str(tmp_path), fault],
                    cwd=REPO,
                    env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        try:
            procs[0].wait(timeout=150)  # rank 0 must come back on its own
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still blocked after 150 s ({fault} of rank 1)")
        if fault == "kill":
            assert procs[1].wait(timeout=30) == -signal.SIGKILL
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    output = (tmp_path / "rank0.log").read_text()
    assert procs[0].returncode == 0, output[-4000:]
    a = _read(tmp_path, "crash", 0)["save"]
    assert a["error"] == "CheckpointAbortedError", a
    assert a["failed_ranks"] == [1], a
    assert "failed on rank(s) [1]" in a["message"] and "rank 1: no status within" in a["message"]
    assert a["seconds"] < CRASH_WITHIN_S[fault], a
    _assert_previous_checkpoint_loads(tmp_path / "ckpt")


def test_replace_dir_moves_the_previous_directory_back_when_the_swap_fails(tmp_path, monkeypatch):
    from microrl.engine.checkpoint import atomic_io

    target, tmp, old = tmp_path / "ckpt", tmp_path / ".ckpt.tmp", tmp_path / ".ckpt.old"
    target.mkdir()
    (target / "v").write_text("previous")
    tmp.mkdir()
    (tmp / "v").write_text("new")
    rename = os.rename

    def failing_rename(src, dst):
        if Path(src) == tmp:
            raise OSError(errno.EIO, "injected rename failure")
        rename(src, dst)

    monkeypatch.setattr(atomic_io.os, "rename", failing_rename)
    with pytest.raises(OSError, match="injected rename failure"):
        atomic_io.replace_dir(tmp, target, old)
    monkeypatch.undo()
    assert (target / "v").read_text() == "previous" and not old.exists()


def test_timeout_comes_from_the_argument_then_the_environment_and_is_checked(monkeypatch):
    monkeypatch.delenv(agreement.TIMEOUT_ENV, raising=False)
    assert agreement.resolve_timeout(None) == agreement.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "12.5")
    assert agreement.resolve_timeout(None) == 12.5
    assert agreement.resolve_timeout(3) == 3.0
    for bad in (0, -1, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="timeout_s"):
            agreement.resolve_timeout(bad)
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=agreement.TIMEOUT_ENV):
        agreement.resolve_timeout(None)
    with pytest.raises(ValueError, match="timeout_s"):  # checked in a single process too
        ckpt.save_checkpoint("unused", model=nn.Linear(1, 1), timeout_s=-1)


# ============================================================================ rank side


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny FSDP2-sharded model with AdamW state: each rank writes its own shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


@torch.no_grad()
def _fill(model: nn.Module, value: float) -> None:
    for p in model.parameters():
        p.fill_(value)


def _values(model: nn.Module) -> list[float]:
    """The distinct values of this rank's parameter shards."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sorted({float(v) for t in local for v in t.detach().unique().tolist()})


def _outcome(call) -> dict:
    start = time.monotonic()
    try:
        call()
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        return {
            "error": type(error).__name__,
            "message": str(error),
            "notes": list(getattr(error, "__notes__", [])),
            "failed_ranks": list(getattr(error, "failed_ranks", []) or []) or None,
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "seconds": time.monotonic() - start}


def _inject(mp: pytest.MonkeyPatch, fault: str) -> None:
    """Make this rank fail as ``fault`` says (test-local monkeypatches, nothing in production)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    def raising(error: BaseException):
        def fail(*args, **kwargs):
            raise error

        return fail

    reason = SAVE_FAULTS.get(fault, (None, None, None))[2]
    write_json = ckpt.write_json

    def failing_write_json(bad_name: str, error: BaseException):
        def write(path, obj):
            if bad_name in (path.name, path.parent.name):
                raise error
            write_json(path, obj)

        return write

    if fault == "prepare":
        mp.setattr(ckpt, "split_state", raising(RuntimeError(reason)))
    elif fault == "disk_full":
        error = OSError(errno.ENOSPC, reason)
        mp.setattr(HuggingFaceStorageWriter, "write_data", raising(error))
    elif fault == "rng_write":
        mp.setattr(ckpt, "write_json", failing_write_json(ckpt.RNG_DIR, PermissionError(reason)))
    elif fault == "finalise":
        mp.setattr(ckpt, "write_json", failing_write_json(ckpt.MANIFEST, OSError(reason)))
    elif fault == "load_check":
        mp.setattr(ckpt, "_read_config", raising(RuntimeError("injected fault while checking")))
    elif fault == "kill":
        mp.setattr(
            HuggingFaceStorageWriter,
            "write_data",
            lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL),
        )
    elif fault == "hang":
        mp.setattr(HuggingFaceStorageWriter, "write_data", lambda *a, **k: time.sleep(3600))
    else:
        raise ValueError(fault)


def _final_state(path: Path) -> dict:
    tmp, old = staging_paths(path.absolute())
    complete = ckpt.is_complete_checkpoint(path)
    return {
        "tmp_left": tmp.exists(),
        "old_left": old.exists(),
        "complete": complete,
        "step": ckpt.read_manifest(path)["step"] if complete else None,
    }


def scenario_faults(rank: int, tmp: Path) -> dict:
    model, optimizer = _build(2)
    path = tmp / "ckpt"
    _fill(model, 1.0)
    ckpt.save_checkpoint(path, model=model, optimizer=optimizer, step=1)
    results: dict = {}
    for fault, (failing, _, _) in SAVE_FAULTS.items():
        _fill(model, 2.0)
        with pytest.MonkeyPatch.context() as mp:
            if rank == failing:
                _inject(mp, fault)
            results[fault] = _outcome(
                lambda: ckpt.save_checkpoint(path, model=model, optimizer=optimizer, step=2)
            )
        results[fault].update(_final_state(path))  # rank 0 removes the temporary directory
    _fill(model, 5.0)
    with pytest.MonkeyPatch.context() as mp:
        if rank == 1:
            _inject(mp, "load_check")
        results["load_check"] = _outcome(
            lambda: ckpt.load_checkpoint(path, model=model, optimizer=optimizer)
        )
    results["load_check"]["values"] = _values(model)
    # The process group still works: the previous checkpoint loads, a new save replaces it.
    info = ckpt.load_checkpoint(path, model=model, optimizer=optimizer)
    results["reload"] = {"step": info.step, "values": _values(model)}
    _fill(model, 3.0)
    ckpt.save_checkpoint(path, model=model, optimizer=optimizer, step=3)
    _fill(model, 0.0)
    info = ckpt.load_checkpoint(path, model=model, optimizer=optimizer)
    results["recovered"] = {"step": info.step, "values": _values(model)}
    return results


def scenario_crash(rank: int, tmp: Path, fault: str) -> dict:
    model, optimizer = _build(2)
    path = tmp / "ckpt"
    _fill(model, 1.0)
    ckpt.save_checkpoint(path, model=model, optimizer=optimizer, step=1, timeout_s=CRASH_TIMEOUT_S)
    _fill(model, 2.0)
    with pytest.MonkeyPatch.context() as mp:
        if rank == 1:
            _inject(mp, fault)  # never returns from the save
        outcome = _outcome(
            lambda: ckpt.save_checkpoint(
                path, model=model, optimizer=optimizer, step=2, timeout_s=CRASH_TIMEOUT_S
            )
        )
    return {"save": outcome}


def main(scenario: str, tmp: str, *args: str) -> None:
    import torch.distributed as dist

    from microrl.engine.parallel import distributed as D

    D.init_distributed()
    rank = dist.get_rank()
    results = globals()[f"scenario_{scenario}"](rank, Path(tmp), *args)
    (Path(tmp) / f"{scenario}_rank{rank}.json").write_text(json.dumps(results))
    sys.stdout.flush()
    if scenario == "crash":
        os._exit(0)  # the peer is dead or hung: no process-group teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])


_STORE_PIN = """
import datetime, sys, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
store = dist.distributed_c10d._get_default_store()
assert isinstance(store, dist.Store), type(store)
store.set("microrl-pin/a", "ok")
assert store.get("microrl-pin/a") == b"ok"
store.wait(["microrl-pin/a"], datetime.timedelta(seconds=1))
try:
    store.wait(["microrl-pin/missing"], datetime.timedelta(milliseconds=200))
except Exception as error:  # the timed wait must raise, not block
    print("timed-out:", type(error).__name__)
dist.destroy_process_group()
"""


def test_the_private_default_store_accessor_still_exists(tmp_path):
    """Pin: the checkpoint agreements use ``torch.distributed.distributed_c10d._get_default_store``
    (private; torch has no public accessor for the rendezvous store in 2.9-2.13). It is reachable
    by every rank without a collective, which is what lets a rank name the ranks that never
    answered. If torch renames or removes it, this test fails and engine/checkpoint/save_load.py must move
    to its replacement (or to a TCPStore client of its own)."""
    proc = subprocess.run(
        [sys.executable, "-c", _STORE_PIN, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "timed-out:" in proc.stdout, proc.stdout


_SIDE_GROUPS = """
import os, sys, torch, torch.distributed as dist
from microrl.engine.checkpoint import agreement

def threads():
    return len(os.listdir("/proc/self/task"))

def init(name):
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + name, rank=0, world_size=1)

before = threads()
init("a")
first = agreement._side_group(5.0)
dist.all_reduce(torch.ones(2), group=first)
dist.destroy_process_group()
init("b")  # a new default group: the cached side group died with the first one
second = agreement._side_group(5.0)
assert second is not first
dist.all_reduce(torch.ones(2), group=second)
dist.destroy_process_group()
del first, second
agreement._release_side_groups()  # what atexit runs
print("threads", before, threads())
"""


def test_side_groups_follow_their_default_group_and_are_freed_before_exit(tmp_path):
    """A side group destroyed with its default group is replaced, not reused; at exit the side
    groups' gloo threads are joined before the interpreter finalizes (joined during it, a thread
    freeing a tensor aborts the process: "terminate called without an active exception")."""
    proc = subprocess.run(
        [sys.executable, "-c", _SIDE_GROUPS, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = map(int, proc.stdout.split()[-2:])
    assert after <= before, proc.stdout  # every gloo thread joined
