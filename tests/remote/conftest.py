"""Tests of ``microrl.remote`` (microrl/remote/), one folder per process as in the package:
``trainer/`` (the ``hf`` worker's handle and pool, vLLM servers, their launch, HTTP client and
placement, full-weight pushes), ``vllm_plugin/`` (the weight-transfer engines vLLM loads).

``test_channel.py`` here tests ``channel.py``, the pipes between the trainer and a worker.

Helpers: ``trainer/hf_worker_utils`` (a tiny engine, its update), ``trainer/route_utils`` (a
stand-in socket module for the trainer address), ``channel_utils`` (stand-in processes).
"""
