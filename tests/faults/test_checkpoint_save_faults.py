"""A run killed while it saves its checkpoint, or whose disk fills up then: the previous
checkpoint (or the new, complete one) survives, and ``--resume`` trains exactly the steps the
uninterrupted run trains, once each.

- Killed while the engine writes its tensors, and between the two renames of the swap (where no
  ``checkpoint/`` exists): the disk as the kill leaves it is copied and resumed.
- ``ENOSPC`` while the engine writes its tensors: the step fails in one line naming the error and
  the file, the previous checkpoint stays in place, and ``--resume`` once space is back is exact.

The checkpoint code's own faults (a rank's disk full, a killed or hung rank, every step of the
swap) are tests/engine/checkpoint/test_checkpoint_faults.py and test_atomic_swap.py.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
from pathlib import Path

import pytest
from example_utils import async_run_args
from fault_utils import Killed, by_step, checkpoint_step, kill_when, nth_call, restore, run
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from microrl.run import StepFailed

STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted synchronous run (a checkpoint every step): its arguments without
    ``output.dir``, the prompts of each step and its metrics."""
    root = tmp_path_factory.mktemp("faults")
    common = [
        *[a for a in async_run_args(root) if not a.startswith("train.steps=")],
        "output.save_every=1", f"train.steps={STEPS}",
    ]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        trained, code = run([*common, f"output.dir={root / 'full'}"], patch)
    assert code == 0 and len(trained) == STEPS
    return common, trained, by_step(root / "full")


def _is_swap_of_step_3(source, target) -> bool:
    """The rename ``.checkpoint.tmp -> checkpoint`` of step 3's save."""
    source = Path(source)
    return (
        source.name == ".checkpoint.tmp"
        and json.loads((source / "run.json").read_text())["step"] == 3
    )


@pytest.mark.parametrize(
    "point, resumed_from",
    [("engine_write", 2), ("swap", 3)],  # the swap's new copy is complete: it is taken
)
def test_a_run_killed_in_its_save_resumes_exactly(
    point, resumed_from, reference, tmp_path, monkeypatch
) -> None:
    common, full, metrics = reference
    out, copy = tmp_path / "run", tmp_path / "as_killed"
    args = [*common, f"output.dir={out}"]
    with monkeypatch.context() as patch:
        if point == "engine_write":  # step 3's save, in the middle of the engine's tensors
            kill_when(patch, HuggingFaceStorageWriter, "write_data", nth_call(3), out, copy)
        else:  # between the renames: checkpoint/ moved aside, the new copy not yet in place
            kill_when(patch, os, "rename", _is_swap_of_step_3, out, copy)
        trained, stopped = run(args, patch)
    assert isinstance(stopped, Killed) and len(trained) == 3
    restore(copy, out)
    assert (out / "checkpoint").is_dir() == (point == "engine_write")
    with monkeypatch.context() as patch:
        resumed, code = run([*args, "--resume"], patch)
    assert code == 0
    assert checkpoint_step(out) == STEPS
    assert [*trained[:resumed_from], *resumed] == full
    assert by_step(out) == metrics


def test_a_full_disk_stops_in_one_line_and_resume_is_exact(reference, tmp_path, monkeypatch):
    common, full, metrics = reference
    out = tmp_path / "run"
    args = [*common, f"output.dir={out}"]
    shard = f"{out}/.checkpoint.tmp/actor/.../model.safetensors"
    write_data = HuggingFaceStorageWriter.write_data
    saves = itertools.count(1)

    def disk_full_at_step_3(*args, **kwargs):  # where a full disk strikes: the tensors
        if next(saves) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), shard)
        return write_data(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(HuggingFaceStorageWriter, "write_data", disk_full_at_step_3)
        trained, stopped = run(args, patch)
    # The step and the error itself, not torch's "CheckpointException ranks:dict_keys([0])" (a
    # BaseException, which the run did not even name the step of).
    assert isinstance(stopped, StepFailed) and len(trained) == 3
    assert str(stopped) == f"step 3: OSError: [Errno 28] No space left on device: '{shard}'"
    assert checkpoint_step(out) == 2  # the previous checkpoint, in place
    # The engine removed what it had written: no partial tensors hold the space.
    assert not [p for p in (out / ".checkpoint.tmp").rglob("*") if p.is_file()]
    with monkeypatch.context() as patch:
        resumed, code = run([*args, "--resume"], patch)
    assert code == 0 and not (out / ".checkpoint.tmp").exists()
    assert [*trained[:2], *resumed] == full
    assert by_step(out) == metrics
