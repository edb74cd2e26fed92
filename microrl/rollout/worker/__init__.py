"""The ``hf`` generation worker process, started by :mod:`microrl.rollout.samplers.hf_worker`."""
