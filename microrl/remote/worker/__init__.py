"""The ``hf`` generation worker process, started by :mod:`microrl.remote.trainer.hf_worker`."""
