"""Tests of benchmarks/: ``gpu_check.sh`` on a machine without CUDA (its syntax and lint, its
one-line exit, its step runner, plans, order of steps and JSON record with stand-in steps, its
set-up's pip calls, the CUDA tests it names, the vision step's transformers gate), the second
session's steps of ``gpu_check_steps.sh`` as far as a CPU goes (their configs, recipe-offload's
resume, the CUDA-IPC round trip's skip), ``bench_gpu_step.py`` in its smallest shape against
TRL, ``version_matrix.py``'s README block, its kernel steps on a CPU (``kernel_cuda_check.py``,
the kernel benchmark's key line), and ``roofline_head.py`` on a tiny shape.
"""
