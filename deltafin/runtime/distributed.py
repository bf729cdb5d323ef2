"""Expert parallelism: every rank holds the trunk, each routed expert is computed by the rank that owns it.

Per MoE layer every rank routes the same tokens (the same trunk math on the same inputs gives the same
routing; ``check`` verifies it for free, ``broadcast`` takes rank 0's), computes the experts it owns into
its [T, k, D] slot buffer (zeros in the slots of other ranks' experts), and one all-reduce sums the
buffers. Each slot is filled on exactly one rank, so the sum is that rank's value exactly, and the sum
over slots that follows (``models/base.moe_dispatch``) is the single-process one, bit for bit.

Rank 0 (the leader) runs the command (prompt, output, HTTP server); before every pass it sends the
followers the step (which sequences, which token ids) over the command group, and they run the same
pass. Sequence states are named by handles: the leader announces new states, copies and frees with the
next step, so every follower mirrors the leader's states. An idle leader pings, so followers waiting
for a step tell a quiet leader from a dead one.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltafin.errors import DistributedError
from deltafin.runtime.cluster import Cluster

log = logging.getLogger(__name__)
ROUTING = ("check", "broadcast")


@dataclass
class CommStats:
    collective_s: float = 0.0  # time in the per-layer all-reduce (includes waiting for the slowest rank)
    collectives: int = 0
    bytes: int = 0  # bytes each rank contributed to the all-reduces


def owners_from_manifest(doc: dict, world: int) -> dict[int, list[int]]:
    """Owner rank of every expert: the manifest's ``experts.ranks`` when placed, else expert id mod world."""
    ex = doc["experts"]
    rk = ex.get("ranks")
    if rk is None:
        return {int(L): [e % world for e in range(ex["num_experts"])] for L in ex["layers"]}
    if rk["world"] != world:
        raise DistributedError(f"the model is placed for {rk['world']} ranks but {world} were launched; launch with "
                               f"--nproc-per-node/--nnodes giving {rk['world']} ranks, or re-run "
                               f"'deltafin place MODEL --ranks SPEC' for {world}")
    return {int(L): list(v) for L, v in rk["owner"].items()}


class DistributedExperts:
    """An ExpertSource over a rank's share of the experts; ``combine`` sums the slot buffers of all ranks."""

    def __init__(self, inner, cluster: Cluster, owners: dict[int, list[int]], routing: str = "check"):
        if routing not in ROUTING:
            raise DistributedError(f"--dist-routing {routing!r}: choose one of {', '.join(ROUTING)}")
        self.inner, self.cl, self.owners, self.routing = inner, cluster, owners, routing
        self.record: list | None = None  # (layer, ids this rank computed) per fetch, as StreamingExperts.record
        self.routes = None
        self.comm = CommStats()

    # what the engine reads of its source
    @property
    def stats(self):
        return self.inner.stats

    def settle_clock(self) -> None:
        self.inner.settle_clock()

    @property
    def direct(self) -> bool:
        return self.inner.direct

    @property
    def cache(self):
        return self.inner.cache

    @property
    def reserved(self) -> tuple[int, int, float]:
        return self.inner.reserved

    def per_drive(self) -> dict[str, dict]:
        return self.inner.per_drive()

    def close(self) -> None:
        self.inner.close()

    # the moe_dispatch protocol
    def agree(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing == "check":
            return ids, weights
        ids, weights = ids.contiguous(), weights.contiguous()
        self._collective(f"routing broadcast of layer {layer}", lambda: dist.broadcast(ids, 0, group=self.cl.data))
        self._collective(f"routing broadcast of layer {layer}", lambda: dist.broadcast(weights, 0, group=self.cl.data))
        return ids, weights

    def local(self, layer: int, wanted: Sequence[int]) -> list[int]:
        own, me = self.owners[layer], self.cl.rank
        mine = [e for e in wanted if own[e] == me]
        if self.record is not None:
            self.record.append((layer, mine))
        return mine

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> Iterator:
        return self.inner.fetch(layer, expert_ids)

    def combine(self, layer: int, out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """All ranks' [T, k, D] slot buffers summed; in float32 the routing ids ride along as a check."""
        check = self.routing == "check" and out.dtype == torch.float32  # ids < 2**24 are exact in float32
        buf = torch.cat([out.reshape(-1), ids.reshape(-1).to(out.dtype)]) if check else out.contiguous()
        self._collective(f"all-reduce of layer {layer}", lambda: dist.all_reduce(buf, group=self.cl.data))
        self.comm.bytes += buf.numel() * buf.element_size()
        if not check:
            return buf
        n = out.numel()
        if not torch.equal(buf[n:], ids.reshape(-1).to(out.dtype) * self.cl.world):
            raise DistributedError(f"the ranks routed layer {layer} differently (their trunk math differs: different "
                                   f"hardware or libraries); run with --dist-routing broadcast")
        return buf[:n].view_as(out)

    def _collective(self, what: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            raise self.cl.diagnose(e, what) from e
        self.comm.collective_s += time.perf_counter() - t0
        self.comm.collectives += 1


def _send(cl: Cluster, cmd: tuple | None) -> tuple:
    """Rank 0's command to every rank (None on the followers: they receive it)."""
    box = [cmd]
    try:
        dist.broadcast_object_list(box, src=0, group=cl.ctl)
    except Exception as e:
        raise cl.diagnose(e, "the step command from rank 0" if not cl.leader else "sending a step command") from e
    return box[0]


def gather(cl: Cluster, obj) -> list:
    """Every rank's ``obj`` (on every rank), over the command group."""
    out = [None] * cl.world
    try:
        dist.all_gather_object(out, obj, group=cl.ctl)
    except Exception as e:
        raise cl.diagnose(e, "gathering from every rank") from e
    return out


class Leader:
    """Rank 0's side: sequence handles, step announcements, pings while idle."""

    def __init__(self, cl: Cluster):
        self.cl = cl
        self.lock = threading.RLock()  # one command at a time: a step is announced and run under it
        self._handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._ops: list[tuple] = []
        self._freed: list[int] = []
        self._next = 0
        self._last = time.monotonic()
        self._closed = threading.Event()
        self.broken: DistributedError | None = None
        self._ping = threading.Thread(target=self._pinger, daemon=True, name="deltafin-leader-ping")
        self._ping.start()

    def _register(self, state) -> int:
        h = self._next
        self._next += 1
        self._handles[state] = h
        weakref.finalize(state, self._freed.append, h)  # list.append is atomic: safe from the collector
        return h

    def new_state(self, state, max_len: int) -> None:
        with self.lock:
            self._ops.append(("new", self._register(state), max_len))

    def copy_state(self, src, dst) -> None:
        with self.lock:
            self._ops.append(("copy", self.handle(src), self._register(dst)))

    def handle(self, state) -> int:
        h = self._handles.get(state)
        assert h is not None, "a sequence state not made by Engine.new_state/copy_state reached a distributed step"
        return h

    @contextmanager
    def step(self, batch: list[tuple[list[int], object]], all_logits: bool):
        """Announce the pass, then run it (the caller's body) under the command lock."""
        with self.lock:
            if self.broken is not None:
                raise self.broken
            freed, self._freed[:] = list(self._freed), []
            ops, self._ops = self._ops + [("free", h) for h in freed], []
            self._send(("step", ops, [(self.handle(st), ids) for ids, st in batch], all_logits))
            try:
                yield
            except DistributedError as e:
                self.broken = e
                raise
            except BaseException as e:  # a local failure mid-step leaves the followers in a collective
                self.cl.record_error(e)
                self.broken = DistributedError(f"rank 0 failed in a step ({type(e).__name__}: {e}); the job stops")
                raise

    def stats(self, mine: dict) -> list[dict]:
        with self.lock:
            self._send(("stats",))
            return gather(self.cl, mine)

    def _send(self, cmd: tuple) -> None:
        _send(self.cl, cmd)
        self._last = time.monotonic()

    def _pinger(self) -> None:
        every = max(min(self.cl.timeout_s / 4, 10.0), 0.5)
        while not self._closed.wait(every / 2):
            if time.monotonic() - self._last < every or not self.lock.acquire(blocking=False):
                continue
            try:
                if not self._closed.is_set() and self.broken is None:
                    self._send(("ping",))
            except DistributedError as e:
                log.warning("rank 0 could not reach the followers: %s", e)
                self.broken = e
            finally:
                self.lock.release()

    def close(self) -> None:
        with self.lock:
            self._closed.set()
            if self.broken is None:
                self._send(("stop",))


def follow(engine, local_stats: Callable[[], dict]) -> None:
    """A follower's loop: run every step rank 0 announces, until it says stop."""
    cl = engine.cluster
    states: dict[int, object] = {}
    while True:
        cmd = _send(cl, None)
        kind = cmd[0]
        if kind == "stop":
            return
        if kind == "stats":
            gather(cl, local_stats())
            continue
        if kind == "ping":
            continue
        _, ops, batch, all_logits = cmd
        for op in ops:
            if op[0] == "new":
                states[op[1]] = engine.model.new_state(op[2])
            elif op[0] == "copy":
                states[op[2]] = copy.deepcopy(states[op[1]])
            else:
                states.pop(op[1], None)
        seqs = [(torch.tensor(ids, dtype=torch.long, device=engine.device), states[h]) for h, ids in batch]
        try:
            engine.local_step(seqs, all_logits)
        except DistributedError:  # another rank's failure, already diagnosed
            raise
        except BaseException as e:  # this rank's own: leave it where rank 0 looks
            cl.record_error(e)
            raise
