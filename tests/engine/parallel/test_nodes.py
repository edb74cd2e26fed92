"""Runs across several nodes (engine/parallel/nodes.py; docs/distributed.md#several-nodes).

- The paths every rank must see: on 2 gloo ranks, a node's own disk is a directory of each
  rank's own (``disk0``, ``disk1``: the same name, different contents, as on two machines).
  ``check_shared_dir`` passes on one directory and raises on every rank otherwise, naming the
  key, the path and the blind rank; ``shared_tempdir`` gives every rank rank 0's directory, and
  names ``TMPDIR`` when a rank cannot see it (that rank's reads stubbed, as on a node whose
  ``/tmp`` is its own). tests/examples/test_examples_multinode.py runs the recipe's checks.
- The GPU of a second node's ranks: ``LOCAL_RANK``, not ``RANK``, picks it (monkeypatched CUDA,
  as in tests/engine/test_device_selection.py): rank 9 of 16 on 8-GPU nodes takes its node's
  GPU 1, rank 1 of 2 on 1-GPU nodes its node's GPU 0.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the ranks
from distributed_utils import run_scenario, scenario_main

from microrl.engine.parallel import distributed, nodes

HERE = Path(__file__).resolve()


# ============================================================================ pytest side


@pytest.mark.distributed
def test_paths_every_rank_must_see_are_checked_on_every_rank(tmp_path: Path) -> None:
    assert run_scenario(tmp_path, 2, HERE, "shared") == [
        "one_directory_passes",
        "own_disks_raise_on_every_rank",
        "unwritable_raises_on_every_rank",
        "shared_tempdir_is_rank0s",
        "blind_tempdir_names_TMPDIR",
        "hosts_gathered",
    ]


def test_a_single_process_checks_nothing(tmp_path: Path) -> None:
    nodes.check_shared_dir(tmp_path / "out", "output.dir")  # nothing to compare with
    assert not (tmp_path / "out").exists()
    path = nodes.shared_tempdir("microrl-test-")
    assert Path(path).is_dir()
    shutil.rmtree(path)
    assert nodes.gather_with_hosts(3) == [(3, socket.gethostname())]


@pytest.mark.parametrize(
    ("rank", "local_rank", "world", "per_node", "gpus"),
    [(9, 1, 16, 8, 8), (1, 0, 2, 1, 1)],
    ids=["rank9_of_2x8", "rank1_of_2x1"],
)
def test_a_second_nodes_rank_takes_its_nodes_gpu(
    monkeypatch, rank: int, local_rank: int, world: int, per_node: int, gpus: int
) -> None:
    """torchrun on the second node: ``RANK`` counts over the nodes, ``LOCAL_RANK`` within this
    one; the GPU index is the local rank (a global one would not exist on an 8-GPU node)."""
    from microrl.configs import EngineConfig
    from microrl.engine import setup
    from microrl.run import Dist

    env = dict(
        RANK=rank,
        LOCAL_RANK=local_rank,
        WORLD_SIZE=world,
        LOCAL_WORLD_SIZE=per_node,
        GROUP_RANK=1,  # the node's rank
    )
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: current.__setitem__(0, int(index)))
    # The group as torchrun's rendezvous made it (initialised: no real one is started here).
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    assert distributed.local_cuda_index() == local_rank
    info = Dist.init()
    assert (info.rank, info.world_size, info.is_main) == (rank, world, False)
    assert current[0] == local_rank
    assert setup.resolve_device(EngineConfig()) == torch.device("cuda", local_rank)


# ============================================================================ rank side


def scenario_shared(rank: int, tmp: Path) -> list[str]:
    distributed.init_distributed()
    nodes._VISIBILITY_WAIT_S = 0.2  # a blind rank gives up sooner (the default covers NFS)
    host = socket.gethostname()
    passed = []

    one = tmp / "shared" / "out"
    nodes.check_shared_dir(one, "output.dir")
    # Made by rank 0; its marker is gone when the check returns, on every rank.
    assert one.is_dir() and not list(one.iterdir())
    passed.append("one_directory_passes")

    own = tmp / f"disk{rank}" / "out"
    with pytest.raises(ValueError) as error:
        nodes.check_shared_dir(own, "output.dir")
    message = str(error.value)
    assert message.startswith(f"output.dir={own} is not the same directory on every process")
    assert f"rank 0 on {host} wrote a file there that rank 1 on {host} cannot read" in message
    assert "docs/distributed.md#several-nodes" in message
    if rank == 0:
        assert not list(own.iterdir())  # the marker is removed on failure too
    passed.append("own_disks_raise_on_every_rank")

    (tmp / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"output\.dir=.*a_file/out: rank 0 cannot write there"):
        nodes.check_shared_dir(tmp / "a_file" / "out", "output.dir")
    passed.append("unwritable_raises_on_every_rank")

    path = nodes.shared_tempdir("microrl-test-")
    paths = nodes.gather_with_hosts(path)
    assert Path(path).is_dir() and all(p == path for p, _ in paths), paths
    assert not os.listdir(path)
    distributed.barrier()
    if rank == 0:
        shutil.rmtree(path)
    passed.append("shared_tempdir_is_rank0s")

    reads = nodes._reads
    if rank == 1:  # this rank's /tmp is its own: it never sees rank 0's files
        nodes._reads = lambda marker, token: False
    try:
        with pytest.raises(ValueError, match="set TMPDIR to the same directory") as error:
            nodes.shared_tempdir("microrl-test-blind-")
    finally:
        nodes._reads = reads
    made = str(error.value).split("the temporary directory ")[1].split(" ")[0]
    assert "rank 1 on" in str(error.value)
    distributed.barrier()
    assert not Path(made).exists()  # rank 0 removed it
    passed.append("blind_tempdir_names_TMPDIR")

    assert nodes.gather_with_hosts(rank * 10) == [(0, host), (10, host)]
    passed.append("hosts_gathered")
    return passed


def main(scenario: str, tmp: str) -> None:
    scenario_main(globals(), scenario, tmp)


if __name__ == "__main__":
    main(*sys.argv[1:])
