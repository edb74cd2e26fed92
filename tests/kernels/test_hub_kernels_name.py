"""The repository's ``kernels/`` folder and Hugging Face's ``kernels`` package, side by side.

A Python started at the repository root (``python -m pytest``, ``python -m microrl grpo``) finds
the folder as the top-level ``kernels``; transformers >= 5.2x imports Hugging Face's package under
that name, and used to get ours (``cannot import name 'CUDAProperties' from 'kernels'``).
Each check runs in a fresh interpreter started at the root, as a user's would be.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_at_root(code: str, extra_path: Path | None = None) -> str:
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _fake_hub_kernels(site: Path) -> Path:
    """A stand-in for Hugging Face's package: its names and a dist-info with a version."""
    package = site / "kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from .layer import CUDAProperties\n__version__ = '0.99.0'\n"
        "def get_kernel(name):\n    return name\n"
    )
    (package / "layer.py").write_text("class CUDAProperties:\n    pass\n")
    info = site / "kernels-0.99.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.99.0\n")
    return site


def test_at_the_root_the_name_kernels_is_hugging_faces_package(tmp_path):
    # What transformers 5.25's hub_kernels does at import, then a model build through microrl.
    out = _run_at_root(
        """
        import importlib, importlib.metadata
        kernels = importlib.import_module("kernels")  # as transformers' hub_kernels imports it
        CUDAProperties, get_kernel = kernels.CUDAProperties, kernels.get_kernel
        again = importlib.import_module("kernels.layer").CUDAProperties
        import microrl.kernels
        from microrl.run.toy_model import build_model
        print(kernels.__file__)
        print(importlib.metadata.version("kernels"), CUDAProperties is again)
        print(microrl.kernels.fused_linear_logprob.__module__)
        """,
        _fake_hub_kernels(tmp_path / "site"),
    )
    hub_file, versions, ours = out.split("\n")[:3]
    assert hub_file == str(tmp_path / "site" / "kernels" / "__init__.py")
    assert versions == "0.99.0 True"
    assert ours == "microrl.kernels.linear_logprob"


def test_at_the_root_without_hugging_faces_package_the_folder_still_imports():
    # transformers' availability check imports the name when it finds no version: no failure.
    out = _run_at_root(
        """
        import importlib.machinery
        find_spec = importlib.machinery.PathFinder.find_spec

        def without_hub_kernels(name, path=None, target=None):
            spec = find_spec(name, path, target)
            hub = name == "kernels" and spec is not None and "site-packages" in spec.origin
            return None if hub else spec

        importlib.machinery.PathFinder.find_spec = without_hub_kernels
        from transformers.utils import import_utils
        print(import_utils._is_package_available("kernels", return_version=True))
        import importlib
        print(importlib.import_module("kernels").fused_linear_logprob.__name__)
        """
    )
    available, ours = out.split("\n")[:2]
    assert available.startswith("(True, "), available  # 'N/A', or the hub's dist-info version
    assert ours == "fused_linear_logprob"


def test_the_installed_hub_package_wins_at_the_root():
    # The test extra installs Hugging Face's package, so CI checks the real one too.
    assert importlib.util.find_spec("kernels") is not None, 'pip install -e ".[test]" installs it'
    out = _run_at_root(
        """
        import importlib
        from transformers.utils import import_utils
        kernels = importlib.import_module("kernels")
        print(kernels.__file__)
        print(import_utils._is_package_available("kernels", return_version=True))
        print(hasattr(kernels, "get_kernel"))
        """
    )
    hub_file, available, has_get_kernel = out.split("\n")[:3]
    assert "site-packages" in hub_file, hub_file
    assert available.startswith("(True, '0."), available
    assert has_get_kernel == "True"
