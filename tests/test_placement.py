from __future__ import annotations

import random

import pytest

from deltafin.store.placement import (
    DriveSpec,
    layer_loads,
    moves,
    place,
    place_bandwidth,
    usage_counts,
)

K3_EXPERT = 17_547_264
REPORT4 = [DriveSpec("internal", 7.0), DriveSpec("tb1", 6.0), DriveSpec("tb2", 6.0), DriveSpec("tb3", 6.0)]


def _sizes(layers: int, experts: int, nbytes: int = K3_EXPERT) -> dict[int, list[int]]:
    return {layer: [nbytes] * experts for layer in range(layers)}


def _assert_balanced(placement, sizes, drives, slack_experts: float = 1.0):
    total_rate = sum(d.gbps for d in drives)
    for layer, load in layer_loads(placement, sizes, len(drives)).items():
        layer_bytes = sum(sizes[layer])
        biggest = max(sizes[layer])
        for d, spec in enumerate(drives):
            assert abs(load[d] - layer_bytes * spec.gbps / total_rate) <= slack_experts * biggest, (layer, d, load)


def _random_trace(tokens, layers, experts, k, seed=0):
    rng = random.Random(seed)
    return [{layer: rng.sample(range(experts), k) for layer in range(layers)} for _ in range(tokens)]


def test_default_policy_is_bandwidth_and_backward_compatible():
    sizes = {1: [100, 200, 300], 3: [50] * 4}
    drives = [DriveSpec("a", 2.0), DriveSpec("b", 1.0)]
    assert place(sizes, drives) == place_bandwidth(sizes, drives)
    out = place(sizes, drives, "bandwidth")
    assert set(out) == {1, 3} and all(len(locs) == 1 for row in out.values() for locs in row)


@pytest.mark.parametrize("policy", ["bandwidth", "coactivation"])
def test_k3_layer_is_balanced_by_bandwidth(policy):
    sizes = _sizes(2, 896)
    trace = _random_trace(64, 2, 896, 16)
    placement = place(sizes, REPORT4, policy, trace=trace)
    _assert_balanced(placement, sizes, REPORT4, slack_experts=1.0 if policy == "bandwidth" else 4.0)


def test_roundrobin_ignores_rates():
    sizes = _sizes(3, 10)
    placement = place(sizes, REPORT4, "roundrobin")
    for layer, load in layer_loads(placement, sizes, 4).items():
        counts = sorted(x // K3_EXPERT for x in load)
        assert counts == [2, 2, 3, 3], (layer, counts)


def test_coactivation_splits_experts_routed_together():
    # experts 2i and 2i+1 are always routed together; two equal drives
    rng = random.Random(1)
    trace = []
    for _ in range(200):
        pairs = rng.sample(range(8), 2)
        trace.append({0: [e for p in pairs for e in (2 * p, 2 * p + 1)]})
    sizes = {0: [1000] * 16}
    drives = [DriveSpec("a", 1.0), DriveSpec("b", 1.0)]
    placement = place(sizes, drives, "coactivation", trace=trace)
    row = placement[0]
    assert all(row[2 * p][0] != row[2 * p + 1][0] for p in range(8))
    assert layer_loads(placement, sizes, 2)[0] == [8000, 8000]


def test_coactivation_lowers_per_token_makespan_on_clustered_trace():
    # 4 clusters of 4 experts each, one cluster routed per token: bandwidth placement may stack a
    # cluster on one drive, co-activation spreads each cluster over all 4 drives
    rng = random.Random(2)
    trace = [{0: [4 * c + i for i in range(4)]} for c in (rng.randrange(4) for _ in range(300))]
    sizes = {0: [1000] * 16}
    drives = [DriveSpec(f"d{i}", 1.0) for i in range(4)]

    def mean_makespan(placement):
        worst = []
        for tok in trace:
            per = [0] * 4
            for e in tok[0]:
                per[placement[0][e][0]] += 1000
            worst.append(max(per))
        return sum(worst) / len(worst)

    co = mean_makespan(place(sizes, drives, "coactivation", trace=trace))
    assert co == 1000  # every cluster spread one expert per drive
    assert co <= mean_makespan(place(sizes, drives, "bandwidth"))


def _stored(placement, nbytes, ndrives):
    out = [0] * ndrives
    for row in placement.values():
        for locs in row:
            for d in locs:
                out[d] += nbytes
    return out


def test_replicas_copy_used_experts_to_other_drives():
    sizes = _sizes(2, 8, 100)
    drives = [DriveSpec("a", 1.0), DriveSpec("b", 1.0)]
    trace = [{0: [0]}] * 10 + [{1: [5]}] * 8 + [{0: [1]}] * 6 + [{0: [2]}]
    placement = place(sizes, drives, "replicas", trace=trace, capacity=[2000, 2000])
    base = place(sizes, drives, "coactivation", trace=trace)
    copies = {(layer, e) for layer, row in placement.items() for e, locs in enumerate(row) if len(locs) > 1}
    assert copies == {(0, 0), (1, 5), (0, 1), (0, 2)}  # every used expert, none unused
    for layer, row in placement.items():
        for e, locs in enumerate(row):
            assert locs[0] == base[layer][e][0] and len(set(locs)) == len(locs)


def test_replicas_fill_spare_space_hottest_first():
    sizes = _sizes(2, 8, 100)
    drives = [DriveSpec("a", 1.0), DriveSpec("b", 1.0)]
    trace = [{0: [0]}] * 10 + [{1: [5]}] * 8 + [{0: [1]}] * 6 + [{0: [2]}]
    base = place(sizes, drives, "coactivation", trace=trace)
    capacity = [s + 100 for s in _stored(base, 100, 2)]  # room for one more expert per drive
    placement = place(sizes, drives, "replicas", trace=trace, capacity=capacity)
    copies = {(layer, e) for layer, row in placement.items() for e, locs in enumerate(row) if len(locs) > 1}
    assert (0, 0) in copies and len(copies) <= 2
    assert all(s <= c for s, c in zip(_stored(placement, 100, 2), capacity, strict=True))


def test_usage_counts_and_bad_trace():
    sizes = {0: [1] * 4}
    assert usage_counts([{0: [1, 2]}, [[2, 3]]], sizes) == {0: [0, 1, 2, 1]}
    with pytest.raises(ValueError, match="expert 9"):
        usage_counts([{0: [9]}], sizes)


def test_policy_errors_name_the_fix():
    sizes = _sizes(1, 4)
    with pytest.raises(ValueError, match="unknown placement policy 'raid'"):
        place(sizes, REPORT4, "raid")
    with pytest.raises(ValueError, match="--record-routes"):
        place(sizes, REPORT4, "coactivation")
    with pytest.raises(ValueError, match="capacity"):
        place(sizes, REPORT4, "replicas", trace=[])
    with pytest.raises(ValueError, match="at least one drive"):
        place(sizes, [])


def test_moves_lists_only_what_changes():
    old = {0: [[0], [1], [0]]}
    new = {0: [[0], [0], [0, 1]]}
    assert moves(old, new) == [(0, 1, (0,), (1,)), (0, 2, (1,), ())]
    assert moves(new, new) == []
