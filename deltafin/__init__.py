"""Deltafin: run Mixture-of-Experts models far larger than memory by streaming routed experts from SSDs."""

__version__ = "0.1.0"
