"""The batch-invariance switch (``kernels.batch_invariant``), in a module of its own so that the backends read it
without importing the dispatch point."""

from __future__ import annotations

import contextvars

ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("deltafin_batch_invariant", default=False)
