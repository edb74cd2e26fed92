"""Tests of ``microrl.rollout`` (microrl/rollout/), one folder per subpackage as in the package:
here the shared layer (the rollout layout, merging, episodes and turns, images, the sampler
interface, the channels between processes, the watcher); ``samplers/`` (the ``hf`` and colocated
vLLM backends, vLLM on the CPU; the ``hf`` worker and its pool, vLLM servers, the sequence-parallel
group's sampler); ``weights/`` (every weight sync and its check); ``worker/`` and
``vllm_plugin/`` (the processes of their own).

Helpers: ``episode_utils`` and ``channel_utils`` here, ``samplers/vllm_utils`` (a stand-in
``vllm.LLM``); ``hf_worker_utils`` and ``route_utils`` at tests/, shared with other folders.
"""
