"""Typed errors raised at the edges (files, CLI, manifests, HTTP).

Every message names the offending thing and what to do about it; the CLI prints the message
without a traceback and exits with status 2.
"""

from __future__ import annotations


class DeltafinError(Exception):
    """Base class for errors a user can act on."""


class UnsupportedArchitectureError(DeltafinError):
    pass


class CheckpointError(DeltafinError):
    """A source checkpoint is missing a shard, a tensor, or has an unexpected dtype/shape."""


class ManifestError(DeltafinError):
    pass


class ExpertFileError(DeltafinError):
    """An expert file is malformed (bad magic, version, truncated)."""


class ExpertChecksumError(ExpertFileError):
    pass


class TrunkFileError(DeltafinError):
    """A packed trunk file is missing, truncated, damaged or does not match the manifest."""


class DriveError(DeltafinError):
    """A drive is missing, unwritable, full, or failed a read."""


class NotEnoughSpaceError(DriveError):
    pass


class ReadError(DriveError):
    """A read failed or came back short; names the drive and the file."""


class CodecError(DeltafinError):
    pass


class UsageError(DeltafinError):
    """Bad command-line or request input."""


class DistributedError(DeltafinError):
    """A run over several ranks failed: a rank died, a collective timed out, or the ranks disagree."""
