"""xxh3-64 hashed in pieces, in order, without holding the GIL.

The reader threads hash each expert part by part as its parts land (``io.pool.Checksum``). Python's
``xxhash.xxh3_64().update`` holds the GIL while it hashes, so hashing on many threads would run one at a time;
its one-shot digests release it. The xxhash library that the Python package carries exports its streaming
functions (``XXH3_64bits_update`` and the rest), and so does the system's ``libxxhash``: called through ctypes,
which releases the GIL for the call, they hash on every thread at once and give the same digest as
``xxhash.xxh3_64_hexdigest`` (checked when loaded). Where neither library can be loaded ``Hasher`` is None and
callers hash the whole read at its end instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

import numpy as np
import xxhash

log = logging.getLogger(__name__)
_lock = threading.Lock()
_lib: list = []  # [the loaded library, or None], once


def _candidates() -> list[str]:
    paths = []
    try:
        import xxhash._xxhash as ext

        paths.append(ext.__file__)
    except (ImportError, AttributeError):
        pass
    found = ctypes.util.find_library("xxhash")
    if found:
        paths.append(found)
    return paths


def _bind(path: str):
    lib = ctypes.CDLL(path)
    lib.XXH3_createState.restype = ctypes.c_void_p
    lib.XXH3_createState.argtypes = []
    lib.XXH3_freeState.argtypes = [ctypes.c_void_p]
    lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
    lib.XXH3_64bits_digest.argtypes = [ctypes.c_void_p]
    lib.XXH3_64bits_digest.restype = ctypes.c_uint64
    # the SIMD-dispatched update where the library has one (AVX2 / AVX-512 chosen at run time)
    update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
    update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    update.restype = ctypes.c_int
    return lib, update


def _load():
    if os.environ.get("DELTAFIN_STREAM_HASH", "1") == "0":
        return None
    probe = np.frombuffer(os.urandom(3 * 65536 + 123), dtype=np.uint8)
    for path in _candidates():
        try:
            lib, update = _bind(path)
            h = _State(lib, update)
            for lo in range(0, probe.size, 65536):
                h.update(memoryview(probe[lo : lo + 65536]))
            if h.hexdigest() == xxhash.xxh3_64_hexdigest(probe):
                return lib, update
            log.warning("xxh3 from %s disagrees with the xxhash package: not used", path)
        except (OSError, AttributeError) as e:
            log.debug("no streaming xxh3 in %s: %s", path, e)
    return None


class _State:
    """One XXH3 state of ``lib``, freed with the object."""

    __slots__ = ("_lib", "_update", "_st")

    def __init__(self, lib, update):
        self._lib, self._update = lib, update
        self._st = lib.XXH3_createState()
        if not self._st:
            raise MemoryError("XXH3_createState")
        lib.XXH3_64bits_reset(self._st)

    def update(self, data: memoryview) -> None:
        arr = np.frombuffer(data, dtype=np.uint8)
        if arr.size:
            self._update(self._st, arr.ctypes.data, arr.size)  # ctypes releases the GIL for the call

    def hexdigest(self) -> str:
        return f"{self._lib.XXH3_64bits_digest(self._st):016x}"

    def __del__(self):
        st, self._st = getattr(self, "_st", None), None
        if st:
            self._lib.XXH3_freeState(st)


def _loaded():
    with _lock:
        if not _lib:
            _lib.append(_load())
    return _lib[0]


def streams() -> bool:
    """Whether reads can be hashed part by part without the GIL here."""
    return _loaded() is not None


def hasher() -> _State | None:
    """A fresh streaming xxh3-64 hasher (``update(view)``, ``hexdigest()``), or None where none loads."""
    got = _loaded()
    return None if got is None else _State(*got)
