"""Reading an expert from whichever of its copies answers: the primary first, then replicas."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from deltafin.errors import ReadError
from deltafin.io.direct import DriveReader

log = logging.getLogger(__name__)


def read_with_replicas(readers: Sequence[DriveReader], locations: Sequence[int], path_for: Callable[[int], str],
                       buf: memoryview, offset: int = 0, nbytes: int | None = None) -> tuple[int, int]:
    """Read into ``buf`` from the first drive in ``locations`` that succeeds.

    ``locations`` are drive indices into ``readers`` in the order to try (the scheduler's choice
    first); ``path_for(d)`` is the file's path on drive d. A failed or short read (fewer than
    ``nbytes``, default ``len(buf)``) moves on to the next copy. Returns (drive index, bytes read);
    raises ``ReadError`` naming every drive and file tried when no copy could be read.
    """
    if not locations:
        raise ValueError("read_with_replicas: no drive holds this file (empty locations)")
    want = len(buf) if nbytes is None else nbytes
    failures = []
    for d in locations:
        path = path_for(d)
        try:
            got = readers[d].read_into(path, offset, buf)
        except ReadError as e:
            failures.append(str(e))
            log.warning("%s; trying another copy" if len(failures) < len(locations) else "%s", e)
            continue
        if got >= want:
            return d, got
        failures.append(f"drive {readers[d].label}: short read of {path}: got {got} of {want} bytes")
        log.warning("%s", failures[-1])
    raise ReadError(f"no copy could be read ({len(locations)} tried): " + "; ".join(failures)
                    + "; check the drives, then run 'deltafin verify'")
