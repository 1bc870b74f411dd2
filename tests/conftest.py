"""Suite-wide settings.

One torch thread per process: tests start servers and workers beside the test process on
machines with two cores, where oversubscribed OpenMP threads spin and slow everyone down.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
