"""Test alias for the tiny-model builder that ships with the package (also used by `deltafin demo`)."""

from deltafin.tiny import TINY, build_tiny

__all__ = ["TINY", "build_tiny"]
