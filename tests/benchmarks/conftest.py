"""Tests of benchmarks/: ``gpu_check.sh`` on a machine without CUDA (its syntax and lint, its
one-line exit, its step runner, order of steps and JSON record with stand-in steps, its set-up's
pip calls, the CUDA tests it names).
"""
