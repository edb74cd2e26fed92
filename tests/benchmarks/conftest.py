"""Tests of benchmarks/: ``gpu_check.sh`` on a machine without CUDA (its syntax and lint, its
one-line exit, its step runner, order of steps and JSON record with stand-in steps, its set-up's
pip calls, the CUDA tests it names), its kernel steps on a CPU (``kernel_cuda_check.py``, the
kernel benchmark's key line), and ``roofline_head.py`` on a tiny shape.
"""
