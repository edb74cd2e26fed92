"""The backends and the samplers: in process (``hf``, colocated vLLM), ``hf`` worker processes
and their pool, ``vllm serve`` servers, and the sequence-parallel group's sampler."""
