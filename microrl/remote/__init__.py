"""Out-of-process sampling for asynchronous RL (docs/async.md): samplers that run beside the trainer.

Each folder is named for the process its files run in:

- ``trainer/``: the trainer's side, the :class:`~microrl.remote.trainer.protocol.AsyncSampler`
  protocol and its samplers (``hf`` worker processes, a pool of them, ``vllm serve`` servers);
- ``worker/``: the ``hf`` generation worker process;
- ``vllm_plugin/``: what vLLM loads into its own processes through the plugin entry point
  (pyproject.toml), so it never imports the training engine;
- ``channel.py``, on both sides: the pipes between the trainer and a worker, which end when
  either process dies.

The training engine never imports this package; this package never imports ``microrl.run``.
"""

import importlib

_API = {
    "AsyncSampler": "microrl.remote.trainer.protocol",
    "Job": "microrl.remote.trainer.protocol",
    "SamplerOptions": "microrl.remote.trainer.protocol",
    "AsyncRollout": "microrl.remote.trainer.hf_worker",
    "AsyncRolloutPool": "microrl.remote.trainer.hf_pool",
    "VLLMServerRollout": "microrl.remote.trainer.vllm_servers",
    "make_async_sampler": "microrl.remote.trainer.factory",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:  # imported on use: a worker process, or vLLM
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_API[name]), name)
