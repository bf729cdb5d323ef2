"""Benchmarks: fixed seeds, one summary line plus a JSON record, every figure beside its limit."""
