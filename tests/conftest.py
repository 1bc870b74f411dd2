"""Suite-wide settings.

One torch thread per process: tests start servers and workers beside the test process on
machines with two cores, where oversubscribed OpenMP threads spin and slow everyone down.

A cache of its own (`XDG_CACHE_HOME`, inherited by the servers and workers the tests start):
the kernels' measured choices (`MeasuredChoice`: which kernel wins per case) are timed
while other tests load the machine, so they must not land in the cache a server started
later on this machine trusts; the compiled kernels there are kept between test runs.
"""

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["XDG_CACHE_HOME"] = str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdserve-tests"
)

import torch

torch.set_num_threads(1)
