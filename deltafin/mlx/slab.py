"""The expert slab: MLX-owned memory that expert files are read into and multiplied from in place.

One MLX uint8 array holds ``slots`` expert files of ``slot_bytes`` (4 KiB multiples) from a 4 KiB-aligned start;
its host view (``numpy.asarray`` of an MLX array shares its memory) gives the readers writable buffers, so a drive's
bytes land where ``gather_qmm`` reads them (no copy). The slab is the reader pool's buffer pool (``get``, ``put``,
``retire``, ``reserve`` as ``io.pool.BufferPool``): a read takes a free slot; a slot given back (its expert evicted
from the cache, or an uncached expert consumed) is only free again once the computation that read it has run,
since MLX builds its graph ahead of the math: the model marks each MoE layer's output as the fence of the slots
given back so far (``fence``), and a slot whose fence has not been evaluated is waited for, never overwritten.
"""

from __future__ import annotations

import threading

import numpy as np

from deltafin.io.direct import ALIGN, align_up
from deltafin.kernels import mlx as km


class ExpertSlab:
    pin = False  # BufferPool's attribute: never page-locked memory

    def __init__(self, slots: int, slot_bytes: int):
        m = km.mx()
        self.slots, self.slot_bytes = slots, align_up(slot_bytes)
        self.u8 = m.zeros((slots * self.slot_bytes + ALIGN,), dtype=m.uint8)
        m.eval(self.u8)
        self._host = np.asarray(self.u8)  # the MLX array's own memory
        assert self._host.flags.writeable, "MLX's host view is read-only: reads cannot land in it"
        self.base = (-self._host.ctypes.data) % ALIGN
        self.start = self._host.ctypes.data + self.base
        self.words = self.u8.view(m.uint32)
        self._free = list(range(slots - 1, -1, -1))
        self._unfenced: list[int] = []  # given back; the computation reading them is still being built
        self._fenced: list[tuple[object, list[int]]] = []  # (fence array, slots) awaiting evaluation
        self._retired: set[int] = set()
        self._lock = threading.Lock()
        self._views: dict[tuple, dict] = {}
        self.waits = 0  # fences evaluated because no slot was free
        self.allocated = slots * self.slot_bytes

    # ---------------------------------------------------------------- BufferPool's interface
    def get(self, nbytes: int) -> memoryview:
        if align_up(nbytes) > self.slot_bytes:
            raise MemoryError(f"an expert of {nbytes:,} bytes does not fit the slab's {self.slot_bytes:,}-byte slots")
        with self._lock:
            if not self._free and self._fenced:
                fences, self._fenced = self._fenced, []
                km.mx().eval(*[f for f, _ in fences if f is not None])  # their readers have run: the slots are free
                self.waits += 1
                for _, slots in fences:
                    self._free.extend(slots)
            if not self._free:
                raise MemoryError(f"every slot of the expert slab ({self.slots} of {self.slot_bytes:,} bytes) holds "
                                  "an expert this layer still reads; lower --cache-gb or raise --prefill-gb")
            s = self._free.pop()
        return self.buffer(s)

    def put(self, buf: memoryview) -> None:
        s = self.slot_of(buf)
        with self._lock:
            if s in self._retired:
                self._retired.discard(s)
                return
            self._unfenced.append(s)

    def retire(self, buf: memoryview) -> None:
        with self._lock:
            self._retired.add(self.slot_of(buf))

    def reserve(self, nbytes: int, count: int) -> int:
        return 0  # the slab is mapped at open

    # ---------------------------------------------------------------- slots
    def buffer(self, slot: int) -> memoryview:
        at = self.base + slot * self.slot_bytes
        return memoryview(self._host[at : at + self.slot_bytes])

    def slot_of(self, where) -> int:
        """The slot holding an address (int), a buffer (memoryview) or a torch tensor viewing the slab."""
        if isinstance(where, memoryview):
            where = np.frombuffer(where, dtype=np.uint8).ctypes.data
        elif hasattr(where, "data_ptr"):
            where = where.data_ptr()
        s, off = divmod(where - self.start, self.slot_bytes)
        assert 0 <= s < self.slots, f"address {where:#x} is outside the slab"
        return s

    def fence(self, arr) -> None:
        """``arr`` reads every slot given back since the last fence: they are free once it is evaluated (None: no
        computation reads them)."""
        with self._lock:
            if self._unfenced:
                self._fenced.append((arr, self._unfenced))
                self._unfenced = []

    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def views(self, tensors: dict) -> dict[str, km.RoleView]:
        """Strided views over every slot of the roles of an expert whose records view one slot (every expert of a
        layer shares its layout, so the views are made once per layout)."""
        s0 = self.slot_of(next(iter(tensors.values())).data)
        at = self.start + s0 * self.slot_bytes
        key = tuple((n, t.format, tuple(t.shape), t.data.data_ptr() - at, str(t.data.dtype),
                     None if t.scale is None else (t.scale.data_ptr() - at, str(t.scale.dtype), tuple(t.scale.shape)))
                    for n, t in sorted(tensors.items()))
        got = self._views.get(key)
        if got is None:
            got = self._views[key] = {n: self._role(t, at) for n, t in tensors.items()}
        return got

    def _role(self, t, at: int) -> km.RoleView:
        m = km.mx()
        dname = str(t.data.dtype).removeprefix("torch.")
        off = self.base + t.data.data_ptr() - at
        if t.format in ("mxfp4", "int4g32"):
            R, C = t.shape
            data = m.as_strided(self.words, (self.slots, R, C // 8), (self.slot_bytes // 4, C // 8, 1), off // 4)
            soff = self.base + t.scale.data_ptr() - at
            sname = str(t.scale.dtype).removeprefix("torch.")
            return km.RoleView(t.format, (R, C), data, km._typed(self.u8, sname, (self.slots, R, C // 32),
                                                                 self.slot_bytes, soff))
        data = km._typed(self.u8, dname, (self.slots, *t.data.shape), self.slot_bytes, off)
        scales = None
        if t.scale is not None:
            sname = str(t.scale.dtype).removeprefix("torch.")
            scales = km._typed(self.u8, sname, (self.slots, *t.scale.shape), self.slot_bytes,
                               self.base + t.scale.data_ptr() - at)
        return km.RoleView(t.format, tuple(t.shape), data, scales)
