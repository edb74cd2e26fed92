"""Tests of benchmarks/: ``gpu_check.sh`` on a machine without CUDA (its syntax, its one-line exit,
its step runner with stand-in steps).
"""
