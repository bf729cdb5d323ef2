"""Deltafin: run Mixture-of-Experts models far larger than memory by streaming routed experts from SSDs."""

import os

__version__ = "0.1.0"
__all__ = ["Generation", "Model", "load", "__version__"]


def __getattr__(name: str):
    """``deltafin.load`` and the API's classes, imported on first use (``deltafin --help`` never loads torch)."""
    if name in ("load", "Model", "Generation"):
        from deltafin import api

        return getattr(api, name)
    raise AttributeError(f"module 'deltafin' has no attribute {name!r}")


# Idle OpenMP threads (torch's and the CPU kernels', one runtime) spin only briefly before they sleep: long
# enough to catch the next matmul of a layer without a wake-up, short enough that the reader threads still
# get the cores between layers (figures in docs/KERNELS.md). GNU OpenMP reads GOMP_SPINCOUNT; LLVM's runtime
# has no shorter setting than KMP_BLOCKTIME=0. Read when torch first loads; whatever the user sets wins.
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"} & set(os.environ):
    os.environ["GOMP_SPINCOUNT"] = "10000"
    os.environ["KMP_BLOCKTIME"] = "0"
