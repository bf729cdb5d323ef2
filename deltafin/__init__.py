"""Deltafin: run Mixture-of-Experts models far larger than memory by streaming routed experts from SSDs."""

import os

__version__ = "0.1.0"

# Idle OpenMP threads (torch's and the CPU kernels', one runtime) sleep instead of spinning, so the reader
# threads and other processes get the cores between matmuls: 3-5x faster fused matmuls on a loaded 2-core
# machine (`deltafin bench kernels`). Read when torch first loads; a value set by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
