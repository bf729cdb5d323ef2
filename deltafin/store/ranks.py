"""Expert ownership over the ranks of a cluster (``deltafin place MODEL --ranks SPEC``), plain Python.

Every rank holds the trunk; each routed expert is owned by exactly one rank, which keeps it on one of
its own drives and caches it in its own memory. Per MoE layer a rank reads only the experts it owns,
so a token's time on rank r is (routed experts it owns that are not cached) x bytes / its drives' rate.

With uniform routing (Kimi K3's router is trained for flat expert use) rank r owning n_r experts of a
layer, with memory for m_r experts per layer, reads k x (n_r - m_r) / E experts per layer on average.
Minimising the slowest rank's time under sum(n_r) = E is water-filling: n_r = m_r + (E - sum m) R_r / sum R
(every rank fills its memory, the uncached rest goes by read rate); when the memory of the cluster holds
every expert, n_r is in proportion to memory and no token reads a drive after the first pass.

The ownership is stored in the manifest as ``experts.ranks`` (optional; validated on load):
``{"world": N, "ranks": [{"drives": [labels], "cache_gb": float}], "owner": {layer: [rank per expert]}}``.
Each expert's locations are on drives of its owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.errors import ManifestError, UsageError

GB = 1e9


@dataclass(frozen=True, slots=True)
class RankSpec:
    drives: tuple[str, ...]  # drive labels this rank reads
    cache_gb: float  # memory this rank gives to cached experts


def parse_ranks(spec: str, labels: list[str]) -> list[RankSpec]:
    """``DRIVES@GB;DRIVES@GB;...`` (rank i is the i-th part, DRIVES comma-separated labels) or ``N@GB``:
    N ranks, drives dealt out in order. ``@GB`` (memory for cached experts) is optional, default 0."""
    form = "'d0,d1@64;d2,d3@64' (each rank's drive labels @ GB of memory for experts) or '2@64'"
    parts = [p.strip() for p in spec.split(";") if p.strip()]
    if not parts:
        raise UsageError(f"--ranks {spec!r}: expected {form}")
    out = []
    for p in parts:
        body, at, gb = p.partition("@")
        try:
            cache = float(gb) if at else 0.0
        except ValueError:
            raise UsageError(f"--ranks: {p!r}: memory {gb!r} is not a number of GB; expected {form}") from None
        if cache < 0:
            raise UsageError(f"--ranks: {p!r}: memory must be >= 0 GB")
        if len(parts) == 1 and body.strip().isdigit():
            n = int(body)
            if not 1 <= n <= len(labels):
                raise UsageError(f"--ranks {spec!r}: {n} ranks need 1..{len(labels)} drives each with at least one; "
                                 f"this model has drives {labels}")
            return [RankSpec(tuple(labels[i::n]), cache) for i in range(n)]
        out.append(RankSpec(tuple(x.strip() for x in body.split(",") if x.strip()), cache))
    _check_drives([r.drives for r in out], labels, f"--ranks {spec!r}")
    return out


def _check_drives(groups: list[tuple[str, ...]] | list[list[str]], labels: list[str], where: str) -> None:
    seen: set[str] = set()
    for r, ds in enumerate(groups):
        if not ds:
            raise UsageError(f"{where}: rank {r} has no drive; every rank that owns experts needs one to read them")
        for d in ds:
            if d not in labels:
                raise UsageError(f"{where}: rank {r} names drive {d!r}, not one of this model's drives {labels}")
            if d in seen:
                raise UsageError(f"{where}: drive {d!r} is given to two ranks; each drive belongs to one rank")
            seen.add(d)


def quotas(num_experts: int, per_layer_bytes: int, ranks: list[RankSpec], rates: list[float]) -> list[int]:
    """Experts per layer each rank owns (module docstring): memory first, the uncached rest by read rate.

    ``per_layer_bytes``: bytes of one expert of every MoE layer together; ``rates[r]``: rank r's summed GB/s.
    """
    E = num_experts
    fit = [r.cache_gb * GB / per_layer_bytes for r in ranks]  # experts per layer each memory holds
    if sum(fit) >= E:
        want = [E * m / sum(fit) for m in fit]
    else:
        want = [m + (E - sum(fit)) * R / sum(rates) for m, R in zip(fit, rates, strict=True)]
    base = [int(w) for w in want]
    order = sorted(range(len(want)), key=lambda r: (base[r] - want[r], r))  # largest remainder first
    for r in order[: E - sum(base)]:
        base[r] += 1
    return base


def plan_owners(locations: dict[int, list[list[int]]], file_bytes: dict[int, int], rate: list[float],
                rank_drives: list[list[int]], counts: list[int]) -> tuple[dict[int, list[int]], dict[int, list[list[int]]]]:
    """(owner per layer and expert, new locations) giving rank r ``counts[r]`` experts of every layer.

    Experts stay with the rank whose drive holds them while its quota lasts (fewest files move), and on
    their drive while it has less than its rate's share of the rank's experts; others go to the rank's
    drive that finishes the layer first (bytes / rate).
    """
    drive_rank = {d: r for r, ds in enumerate(rank_drives) for d in ds}
    owners, new_locs = {}, {}
    for L, locs in locations.items():
        E = len(locs)
        owner: list[int | None] = [None] * E
        left = list(counts)
        for e, loc in enumerate(locs):
            r = drive_rank.get(loc[0])
            if r is not None and left[r] > 0:
                owner[e], left[r] = r, left[r] - 1
        for e in range(E):
            if owner[e] is None:
                r = max(range(len(left)), key=lambda x: (left[x], -x))
                owner[e], left[r] = r, left[r] - 1
        new_locs[L] = _drives_of_rank(locs, owner, rank_drives, rate, counts, file_bytes[L])
        owners[L] = owner
    return owners, new_locs


def _drives_of_rank(locs, owner, rank_drives, rate, counts, nbytes) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in locs]
    load = {d: 0 for ds in rank_drives for d in ds}
    share = {d: counts[r] * rate[d] / sum(rate[x] for x in ds) for r, ds in enumerate(rank_drives) for d in ds}
    moved = []
    for e, loc in enumerate(locs):
        if loc[0] in rank_drives[owner[e]] and load[loc[0]] + 1 <= share[loc[0]] + 0.5:
            out[e] = [loc[0]]
            load[loc[0]] += 1
        else:
            moved.append(e)
    for e in moved:
        d = min(rank_drives[owner[e]], key=lambda x: ((load[x] + 1) * nbytes / rate[x], x))
        out[e] = [d]
        load[d] += 1
    return out


def ranks_doc(ranks: list[RankSpec], owners: dict[int, list[int]]) -> dict:
    return {"world": len(ranks), "ranks": [{"drives": list(r.drives), "cache_gb": r.cache_gb} for r in ranks],
            "owner": {str(L): v for L, v in sorted(owners.items())}}


def check_ranks(ex: dict, labels: list[str], where: str) -> None:
    """Validate ``experts.ranks``: every expert owned by one rank, located on that rank's drives."""
    rk = ex["ranks"]
    fix = "re-run 'deltafin place MODEL --ranks SPEC'"
    if not (isinstance(rk, dict) and isinstance(rk.get("world"), int) and rk["world"] >= 1
            and isinstance(rk.get("ranks"), list) and len(rk["ranks"]) == rk["world"]
            and isinstance(rk.get("owner"), dict)):
        raise ManifestError(f"{where}: experts.ranks needs world >= 1, one entry per rank and an owner map; {fix}")
    groups = []
    for r, ent in enumerate(rk["ranks"]):
        if not (isinstance(ent, dict) and isinstance(ent.get("drives"), list)
                and isinstance(ent.get("cache_gb"), int | float) and ent["cache_gb"] >= 0):
            raise ManifestError(f"{where}: experts.ranks rank {r} needs a list of drives and cache_gb >= 0; {fix}")
        groups.append(ent["drives"])
    try:
        _check_drives(groups, labels, f"{where}: experts.ranks")
    except UsageError as e:
        raise ManifestError(f"{e}; {fix}") from None
    index = {lab: i for i, lab in enumerate(labels)}
    for L in ex["layers"]:
        own = rk["owner"].get(str(L))
        if not isinstance(own, list) or len(own) != ex["num_experts"]:
            raise ManifestError(f"{where}: experts.ranks has no owner for every expert of layer {L}; {fix}")
        for e, r in enumerate(own):
            if not isinstance(r, int) or not 0 <= r < rk["world"]:
                raise ManifestError(f"{where}: layer {L} expert {e} is owned by rank {r!r}, not a rank; {fix}")
            mine = {index[d] for d in groups[r]}
            if not set(ex["locations"][str(L)][e]) <= mine:
                raise ManifestError(f"{where}: layer {L} expert {e} is owned by rank {r} but lives on a drive of "
                                    f"another rank; {fix}")
