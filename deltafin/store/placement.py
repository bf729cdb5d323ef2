"""Placement of expert files over drives. Plain Python (numpy for co-activation counts): no torch, no files.

Every MoE layer waits for its slowest read, so balance is kept *per layer*: within each layer, each
drive gets a share of the layer's expert bytes proportional to its read rate.

A placement maps layer -> expert -> [drive indices], primary first; further indices are replicas
(whole copies the scheduler may read instead). Policies:
  * ``bandwidth``: greedy per layer on bytes / rate;
  * ``coactivation``: from a routing trace, experts often routed together in a layer go to
    different drives, still balanced by rate (greedy on the expected squared drive time);
  * ``replicas``: ``coactivation`` (or ``bandwidth`` without a trace), plus extra copies of the
    most-used experts on each drive's spare space;
  * ``roundrobin``: equal counts per drive whatever its rate (the RAID-like baseline).

Striped layouts (``STRIPE_POLICIES``) cut every expert file into one 4 KiB-aligned piece per drive
instead: ``stripe-bandwidth`` sizes the pieces by read rate, ``stripe-equal`` makes them equal (RAID-0).
``stripe_pieces`` gives the cut; the arithmetic is ``deltafin.io.schedule``'s.

A routing trace is a sequence of tokens; each token maps layer id -> routed expert ids (a dict,
or a list indexed by layer id).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("bandwidth", "coactivation", "replicas", "roundrobin")
STRIPE_POLICIES = {"stripe-bandwidth": "bandwidth", "stripe-equal": "equal"}  # policy -> manifest stripe mode
ALL_POLICIES = POLICIES + tuple(STRIPE_POLICIES)
TRACE_POLICIES = ("coactivation", "replicas")

Placement = dict[int, list[list[int]]]
Trace = Sequence[Mapping[int, Sequence[int]] | Sequence[Sequence[int]]]


@dataclass(frozen=True, slots=True)
class DriveSpec:
    label: str
    gbps: float  # read rate, GB/s

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"drive {self.label}: read rate must be > 0 GB/s, got {self.gbps}")


def place_bandwidth(sizes: dict[int, list[int]], drives: list[DriveSpec]) -> dict[int, list[list[int]]]:
    """Greedy per layer: each expert goes to the drive whose finish time (bytes / rate) stays lowest.

    ``sizes[layer][e]`` is expert e's file size; the result maps layer -> expert -> [drive index].
    Ties go to the lower drive index, so the result is deterministic.
    """
    out: dict[int, list[list[int]]] = {}
    for layer, layer_sizes in sizes.items():
        load = [0.0] * len(drives)
        row: list[list[int]] = []
        for nbytes in layer_sizes:
            best = min(range(len(drives)), key=lambda d: ((load[d] + nbytes) / drives[d].gbps, d))
            load[best] += nbytes
            row.append([best])
        out[layer] = row
    return out


def place_roundrobin(sizes: dict[int, list[int]], drives: list[DriveSpec]) -> Placement:
    """Equal round-robin per layer, ignoring rates (baseline). Offset by layer so no drive gets
    every layer's remainder."""
    n = len(drives)
    return {layer: [[(e + layer) % n] for e in range(len(row))] for layer, row in sizes.items()}


# ---------------------------------------------------------------- routing traces


def layer_routes(trace: Trace, layer: int) -> list[Sequence[int]]:
    """The routed expert ids of ``layer`` for every token of ``trace`` that has that layer."""
    out = []
    for tok in trace:
        if isinstance(tok, Mapping):
            if layer in tok:
                out.append(tok[layer])
        elif 0 <= layer < len(tok):
            out.append(tok[layer])
    return out


def usage_counts(trace: Trace, sizes: dict[int, list[int]]) -> dict[int, list[int]]:
    """How many tokens of ``trace`` routed to each expert: layer -> expert -> count."""
    out = {}
    for layer, row in sizes.items():
        counts = [0] * len(row)
        for route in layer_routes(trace, layer):
            for e in route:
                if not 0 <= e < len(row):
                    raise ValueError(f"routing trace: layer {layer} routes to expert {e}, but the layer has "
                                     f"{len(row)} experts; record the trace with the same model")
                counts[e] += 1
        out[layer] = counts
    return out


def _coactivation(routes: list[Sequence[int]], n_experts: int):
    """Probabilities: p[e] that a token routes to e, P[e, f] that it routes to both (shrunk to uniform)."""
    import numpy as np

    C = np.zeros((n_experts, n_experts), dtype=np.float64)
    by_k: dict[int, list[Sequence[int]]] = {}
    for r in routes:
        by_k.setdefault(len(r), []).append(r)
    for k, group in by_k.items():
        R = np.asarray(group, dtype=np.int64).reshape(len(group), k)
        flat = (R[:, :, None] * n_experts + R[:, None, :]).ravel()
        C += np.bincount(flat, minlength=n_experts * n_experts).reshape(n_experts, n_experts)
    N = len(routes)
    k = (sum(len(r) for r in routes) / N) if N else 1.0
    m = n_experts / max(k, 1.0)  # pseudo-tokens: an unseen expert counts as seen about once
    p0 = k / n_experts
    pair0 = k * max(k - 1.0, 0.0) / (n_experts * max(n_experts - 1, 1))
    P = (C + m * pair0) / (N + m)
    np.fill_diagonal(P, (np.diag(C) + m * p0) / (N + m))
    return P


def _coact_layer(row: list[int], drives: list[DriveSpec], routes: list[Sequence[int]],
                 capacity: list[float] | None) -> list[list[int]]:
    import numpy as np

    E, D = len(row), len(drives)
    P = _coactivation(routes, E)
    s = np.asarray(row, dtype=np.float64)
    rate = [d.gbps for d in drives]
    A = np.zeros((D, E))  # A[d, e] = sum over f placed on d of P[e, f] * s[f]
    stored = [0.0] * D
    out: list[list[int]] = [[] for _ in range(E)]
    # Each expert goes where it adds least to sum_d E[L_d^2] / r_d (L_d: a token's bytes on drive d);
    # that balances mean load by rate and keeps co-routed experts apart.
    for e in sorted(range(E), key=lambda e: (-P[e, e], e)):
        best, best_cost = None, None
        for d in range(D):
            if capacity is not None and stored[d] + row[e] > capacity[d]:
                continue
            cost = (2 * s[e] * A[d, e] + P[e, e] * s[e] ** 2) / rate[d]
            if best_cost is None or cost < best_cost - 1e-9 * abs(best_cost):
                best, best_cost = d, cost
        if best is None:
            raise ValueError(f"no drive has room for an expert of {row[e]} bytes; free space or add a drive")
        A[best] += P[:, e] * s[e]
        stored[best] += row[e]
        out[e] = [best]
    return out


def place_coactivation(sizes: dict[int, list[int]], drives: list[DriveSpec], trace: Trace,
                       capacity: Sequence[int] | None = None) -> Placement:
    """Per layer, keep experts that the trace routes together on different drives, balanced by rate.

    Layers the trace does not cover fall back to rate balance (the uniform prior).
    ``capacity[d]`` (bytes), when given, bounds what each drive stores of every layer together.
    """
    left = [float(c) for c in capacity] if capacity is not None else None
    out: Placement = {}
    for layer, row in sizes.items():
        out[layer] = _coact_layer(row, drives, layer_routes(trace, layer), left)
        if left is not None:
            for e, locs in enumerate(out[layer]):
                left[locs[0]] -= row[e]
    return out


# ---------------------------------------------------------------- replicas


def add_replicas(placement: Placement, sizes: dict[int, list[int]], drives: list[DriveSpec],
                 usage: dict[int, list[int]], capacity: Sequence[int], max_replicas: int = 1) -> Placement:
    """Copy the most-used experts (by ``usage`` counts) onto spare space, at most ``max_replicas``
    extra copies each. ``capacity[d]`` is the bytes drive d may hold for this model.

    Each copy goes to the drive (not already holding it) with the least expected traffic for that
    layer per unit of rate, so the scheduler can read from whichever copy is less loaded.
    """
    if len(capacity) != len(drives):
        raise ValueError(f"capacity lists {len(capacity)} drives, but there are {len(drives)}")
    out = {layer: [list(locs) for locs in row] for layer, row in placement.items()}
    spare = [float(c) for c in capacity]
    traffic = {layer: [0.0] * len(drives) for layer in out}
    for layer, row in out.items():
        for e, locs in enumerate(row):
            for d in locs:
                spare[d] -= sizes[layer][e]
                traffic[layer][d] += usage.get(layer, [0] * len(row))[e] * sizes[layer][e] / len(locs)
    hot = sorted(((c, layer, e) for layer, row in usage.items() for e, c in enumerate(row) if c > 0),
                 key=lambda x: (-x[0], x[1], x[2]))
    for _ in range(max_replicas):
        for c, layer, e in hot:
            _add_copy(out[layer][e], sizes[layer][e], c, traffic[layer], spare, drives)
    return out


def _add_copy(locs: list[int], nbytes: int, count: int, traffic: list[float], spare: list[float],
              drives: list[DriveSpec]) -> None:
    options = [d for d in range(len(drives)) if d not in locs and spare[d] >= nbytes]
    if not options:
        return
    d = min(options, key=lambda d: (traffic[d] / drives[d].gbps, -spare[d], d))
    share = count * nbytes
    for old in locs:
        traffic[old] -= share / len(locs) - share / (len(locs) + 1)
    traffic[d] += share / (len(locs) + 1)
    spare[d] -= nbytes
    locs.append(d)


# ---------------------------------------------------------------- striping


def stripe_pieces(file_bytes: int, drives: list[DriveSpec], mode: str) -> list[tuple[int, int, int]]:
    """One expert file cut over ``drives``: [(drive, offset, nbytes)], contiguous, 4 KiB-aligned.

    ``mode`` "bandwidth" sizes pieces by read rate; "equal" cuts equal pieces (RAID-0-like).
    """
    from deltafin.io.schedule import stripe_bandwidth, stripe_equal

    if mode == "bandwidth":
        pieces = stripe_bandwidth(file_bytes, [d.gbps for d in drives])
    elif mode == "equal":
        pieces = stripe_equal(file_bytes, len(drives))
    else:
        raise ValueError(f"unknown stripe mode {mode!r}; known: bandwidth, equal")
    return [(p.drive, p.offset, p.nbytes) for p in pieces]


# ---------------------------------------------------------------- entry points


def layer_loads(placement: Placement, sizes: dict[int, list[int]], ndrives: int) -> dict[int, list[int]]:
    """Bytes of each layer stored on each drive as primary copy: layer -> [bytes per drive]."""
    out = {}
    for layer, row in placement.items():
        load = [0] * ndrives
        for e, locs in enumerate(row):
            load[locs[0]] += sizes[layer][e]
        out[layer] = load
    return out


def moves(old: Placement, new: Placement) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """What changes between two placements: (layer, expert, drives to copy to, drives to delete from).

    Copies come before deletions when applied, so an expert is never without a copy.
    """
    out = []
    for layer, row in new.items():
        for e, locs in enumerate(row):
            before = old.get(layer, [])
            had = set(before[e]) if e < len(before) else set()
            add = tuple(d for d in locs if d not in had)
            drop = tuple(sorted(had - set(locs)))
            if add or drop:
                out.append((layer, e, add, drop))
    return out


def place(sizes: dict[int, list[int]], drives: list[DriveSpec], policy: str = "bandwidth", *,
          trace: Trace | None = None, capacity: Sequence[int] | None = None, max_replicas: int = 1
          ) -> Placement:
    """Place every expert file: layer -> expert -> [drive indices], primary first.

    ``trace`` (routing trace) is needed by "coactivation"; "replicas" needs ``capacity`` (bytes
    per drive for this model) and a trace to rank experts by use.
    """
    if not drives:
        raise ValueError("placement needs at least one drive")
    if policy == "bandwidth":
        return place_bandwidth(sizes, drives)
    if policy == "roundrobin":
        return place_roundrobin(sizes, drives)
    if policy in ("coactivation", "replicas") and trace is None:
        raise ValueError(f"placement policy {policy!r} needs a routing trace; record one with --record-routes")
    if policy == "coactivation":
        return place_coactivation(sizes, drives, trace, capacity)
    if policy == "replicas":
        if capacity is None:
            raise ValueError("placement policy 'replicas' needs each drive's capacity (bytes) to find spare space")
        base = place_coactivation(sizes, drives, trace, capacity)
        return add_replicas(base, sizes, drives, usage_counts(trace, sizes), capacity, max_replicas)
    raise ValueError(f"unknown placement policy {policy!r}; known: {', '.join(POLICIES)}")
