"""The trainer process's side of out-of-process sampling: the sampler protocol and its samplers."""
