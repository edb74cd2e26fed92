"""The fault suite: microrl under the faults a shared machine deals it (docs/faults.md), each
injected at a chosen point of a tiny run or sampler, each asserting a bounded stop with a clear
message, the previous checkpoint intact and an exact ``--resume``.

A kill of the trainer mid-save is simulated in process: the output directory is copied as the
kill would leave it (:func:`fault_utils.as_killed`), the run is stopped, and the copy resumed.
Helpers: ``fault_utils`` (here), ``example_utils`` (tests/: the tiny recipe runs).
"""
