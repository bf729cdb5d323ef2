"""The process group of a run over several ranks (``torchrun``), and how a failure is named.

Ranks find each other through the environment ``torchrun`` sets (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``). Data collectives (one all-reduce per MoE layer) run on gloo for
CPUs and NCCL for CUDA; the leader's step commands always go over a separate gloo group, so they are
plain Python objects on the CPU. Every group has a timeout, so nothing waits forever.

Naming the rank that failed: a rank that raises records its error in the rendezvous store before it
leaves; every rank also bumps a heartbeat counter there once a second from a small thread. When a
collective fails or times out, a rank looks for a recorded error first, then for ranks whose
heartbeat stopped, and raises ``DistributedError`` with what it found.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from deltafin.errors import DistributedError

log = logging.getLogger(__name__)
BEAT_S = 1.0
JOIN_S = 1800.0  # how long ranks wait for each other to open a model (trunk loads can take minutes)
PREFIX = "deltafin/"


def world_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number; launch with torchrun") from None


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


@dataclass
class Cluster:
    rank: int
    world: int
    local_world: int
    device: torch.device
    timeout_s: float
    ctl: object  # gloo group for the leader's commands
    store: object
    data: object = None  # None: the default group (gloo on CPU, NCCL on CUDA)
    joins: int = 0  # engines opened on this group so far (each joins once, in the same order on every rank)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def record_error(self, exc: BaseException) -> None:
        """Leave this rank's error where the others look when their collectives fail."""
        try:
            self.store.set(f"error/{self.rank}", f"{type(exc).__name__}: {exc}"[:2000])
        except Exception:  # the store may be gone with rank 0; the local error is raised anyway
            log.debug("could not record the error of rank %d", self.rank, exc_info=True)

    def diagnose(self, exc: BaseException, what: str) -> DistributedError:
        """The error to raise after collective ``what`` failed with ``exc``: names the rank when it can."""
        exc = str(exc).splitlines()[0][:240] if str(exc) else type(exc).__name__
        others = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + 3 * BEAT_S
        while True:  # a rank that raised writes its error before it leaves; give it a moment
            for r in others:
                msg = self._get(f"error/{r}")
                if msg is not None:
                    return DistributedError(f"rank {r} of {self.world} failed ({msg}); the job stops ({what})")
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        before = {r: self._beats(r) for r in others}
        time.sleep(2.5 * BEAT_S)
        dead = [r for r in others if before[r] is None or self._beats(r) == before[r]]
        if dead:
            hosts = ", ".join(f"rank {r} ({self._get(f'host/{r}') or 'host unknown'})" for r in dead)
            return DistributedError(f"{hosts} stopped answering: the process died or its machine is unreachable; "
                                    f"the job stops ({what}: {exc})")
        return DistributedError(f"{what} did not complete within {self.timeout_s:g} s on rank {self.rank} although "
                                f"every rank is alive ({exc}); a rank is stuck (a drive that stopped answering?) or "
                                f"--dist-timeout is too short for one step")

    def join(self, what: str, mine: str, wait_s: float = JOIN_S) -> None:
        """Wait for every rank to open the same thing (model, ownership, options), through the store: ranks
        may finish loading minutes apart (a trunk read from different disks), longer than a collective may
        wait. A rank that recorded an error, stopped beating or differs is named."""
        self.joins += 1
        key = f"join/{self.joins}/"
        self.store.set(key + str(self.rank), mine)
        deadline, beats, seen = time.monotonic() + wait_s, {}, {}
        while True:
            got = {r: self._get(key + str(r)) for r in range(self.world)}
            if all(v is not None for v in got.values()):
                break
            for r in range(self.world):
                msg = self._get(f"error/{r}") if r != self.rank else None
                if msg is not None:
                    raise DistributedError(f"rank {r} of {self.world} failed ({msg}); the job stops")
                b = self._beats(r)
                if b != beats.get(r):
                    beats[r], seen[r] = b, time.monotonic()
                elif time.monotonic() - seen[r] > 5 * BEAT_S and got[r] is None:
                    raise DistributedError(f"rank {r} ({self._get(f'host/{r}') or 'host unknown'}) stopped answering "
                                           f"while opening the model; the job stops")
            if time.monotonic() > deadline:
                late = [r for r, v in got.items() if v is None]
                raise DistributedError(f"ranks {late} did not open the model within {wait_s:g} s; the job stops")
            time.sleep(0.2)
        for r, v in got.items():
            if v != got[0]:
                raise DistributedError(f"rank {r} has {what} {v} but rank 0 has {got[0]}; launch every rank with the "
                                       f"same model and options")

    def _get(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:
            return None

    def _beats(self, r: int) -> int | None:
        try:
            return self.store.add(f"beat/{r}", 0)
        except Exception:
            return None

    def close(self) -> None:
        self._stop.set()


def _heartbeat(store_args: tuple, rank: int, stop: threading.Event) -> None:
    """Bump ``beat/RANK`` once a second on a store client of its own (the main one is busy in collectives)."""
    try:
        store = dist.PrefixStore(PREFIX, dist.TCPStore(*store_args[:2], is_master=False, timeout=store_args[2]))
        while not stop.wait(BEAT_S):
            store.add(f"beat/{rank}", 1)
    except Exception:  # the store went away: the job is ending, and the collectives will say why
        log.debug("heartbeat of rank %d stopped", rank, exc_info=True)


def init(device: torch.device, timeout_s: float) -> Cluster:
    """Join the process group described by the environment (torchrun), or reuse the one joined already."""
    global _CLUSTER
    if _CLUSTER is not None:
        return _CLUSTER
    world, rank = world_from_env(), rank_from_env()
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    timeout = timedelta(seconds=timeout_s)
    # under torchrun the agent hosts the store; launched by hand, rank 0 does
    master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    try:
        base = dist.TCPStore(host, port, world, master, timeout=timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, store=dist.PrefixStore("pg/", base), rank=rank, world_size=world,
                                timeout=timeout)
        ctl = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    except Exception as e:
        raise DistributedError(f"rank {rank} of {world} could not join the process group at {host}:{port} within "
                               f"{timeout_s:g} s ({e}); is every rank started (torchrun --nnodes/--nproc-per-node) "
                               f"and MASTER_ADDR reachable?") from e
    store = dist.PrefixStore(PREFIX, base)
    store.set(f"host/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    dev = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device
    cl = Cluster(rank, world, local, dev, timeout_s, ctl, store)
    threading.Thread(target=_heartbeat, args=((host, port, timeout), rank, cl._stop), daemon=True,
                     name=f"deltafin-beat-{rank}").start()
    _CLUSTER = cl
    return cl


_CLUSTER: Cluster | None = None


def shutdown() -> None:
    """Leave the process group (end of a launch)."""
    global _CLUSTER
    if _CLUSTER is not None:
        _CLUSTER.close()
        _CLUSTER = None
    if dist.is_initialized():
        dist.destroy_process_group()
