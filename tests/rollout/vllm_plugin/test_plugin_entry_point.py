"""vLLM loads microrl's plugin into every process it starts: registering it must not import the
training engine (torch is all it needs), and the entry point must name the function that exists."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_the_entry_point_registers_without_importing_the_engine() -> None:
    (point,) = [
        e for e in entry_points(group="vllm.general_plugins") if e.name.startswith("microrl")
    ]
    code = (
        "import sys\n"
        "from importlib.metadata import entry_points\n"
        f"(point,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == {point.name!r}]\n"
        "point.load()()\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('microrl'))\n"
        "print(loaded)\n"
        "assert not any(m.startswith('microrl.engine') for m in loaded), loaded\n"
        "assert not any(m.startswith('microrl.run') for m in loaded), loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert point.value == "microrl.rollout.vllm_plugin.transfer:register"
