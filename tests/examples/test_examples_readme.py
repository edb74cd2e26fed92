"""The README's Python samples run as written (each in a fresh interpreter namespace)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def test_readme_has_the_tour_samples() -> None:
    blocks = BLOCK.findall(README.read_text())
    text = "\n".join(blocks)
    for piece in ("fused_linear_logprob", "policy_loss", "loss_fn=", "class ", "(Engine)"):
        assert piece in text, piece


def test_readme_python_blocks_run() -> None:
    blocks = BLOCK.findall(README.read_text())
    assert blocks
    # One interpreter for all blocks (imports are paid once), a fresh namespace per block.
    runner = "import sys\nfor i, code in enumerate(sys.argv[1:]):\n    exec(compile(code, f'README block {i}', 'exec'), {'__name__': '__main__'})\n"
    result = subprocess.run(
        [sys.executable, "-c", runner, *blocks], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
