"""Deltafin: run Mixture-of-Experts models far larger than memory by streaming routed experts from SSDs."""

import os

__version__ = "0.1.0"

# Idle OpenMP threads (torch's and the CPU kernels', one runtime) spin only briefly before they sleep: long
# enough to catch the next matmul of the same expert or layer (waking a sleeping thread took longer than a
# small expert's whole matmul on one core), short enough that the reader threads and other processes still
# get the cores between layers. Measured with `deltafin bench kernels` on the 2-core machine: the one-token
# K3 expert at 0.65 of memory bandwidth against 0.49 when idle threads sleep at once (OMP_WAIT_POLICY=PASSIVE,
# which had been 3-5x better than unbounded spinning on a loaded machine). GNU OpenMP reads GOMP_SPINCOUNT;
# LLVM's runtime (KMP_BLOCKTIME, in ms) has no shorter setting than 0, sleeping at once. Read when torch
# first loads; whatever the user sets wins.
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"} & set(os.environ):
    os.environ["GOMP_SPINCOUNT"] = "10000"
    os.environ["KMP_BLOCKTIME"] = "0"
