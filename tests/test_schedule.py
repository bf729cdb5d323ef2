from __future__ import annotations

import pytest

from deltafin.io.schedule import (
    ALIGN,
    Piece,
    ReadRequest,
    layer_requests,
    schedule_layer,
    stripe_bandwidth,
    stripe_equal,
)

K3_EXPERT = 17_547_264
GB = 10**9


@pytest.mark.parametrize("nbytes", [K3_EXPERT, K3_EXPERT + 123, 4096, 5000, 10**9 + 7])
@pytest.mark.parametrize("rates", [[7, 6, 6, 6], [1.0], [14, 2.5, 2.5, 2.5], [3, 0.01]])
def test_stripe_bandwidth_sums_aligned_and_proportional(nbytes, rates):
    pieces = stripe_bandwidth(nbytes, rates)
    assert sum(p.nbytes for p in pieces) == nbytes
    offset = 0
    for p in pieces:
        assert p.offset == offset and p.offset % ALIGN == 0
        offset += p.nbytes
    for p in pieces[:-1]:
        assert p.nbytes % ALIGN == 0
    units = -(-nbytes // ALIGN)
    for p in pieces:
        ideal = units * rates[p.drive] / sum(rates)
        assert abs(-(-p.nbytes // ALIGN) - ideal) < 1  # largest remainder: within one unit of the exact share


def test_stripe_bandwidth_k3_expert_on_report_drives():
    pieces = stripe_bandwidth(K3_EXPERT, [7, 6, 6, 6])
    assert [p.nbytes for p in pieces] == [4_915_200, 4_210_688, 4_210_688, 4_210_688]
    assert [p.drive for p in pieces] == [0, 1, 2, 3]


def test_stripe_equal_is_raid0_like():
    pieces = stripe_equal(K3_EXPERT, 4)
    assert sum(p.nbytes for p in pieces) == K3_EXPERT
    assert {p.nbytes for p in pieces} == {K3_EXPERT // 4}
    small = stripe_equal(10_000, 3)
    assert [p.nbytes for p in small] == [4096, 4096, 1808]


def test_makespan_hand_computed():
    # drive 0: 1 GB/s, one read of 1 GB -> 1.0 s; drive 1: 2 GB/s, 3 GB -> 1.5 s
    reqs = [ReadRequest(0, GB, replicas=(0,)), ReadRequest(1, GB, replicas=(1,)), ReadRequest(2, 2 * GB, replicas=(1,))]
    s = schedule_layer(reqs, [1.0, 2.0])
    assert s.makespan_s == pytest.approx(1.5)
    assert s.ideal_s == pytest.approx(4 / 3)
    assert s.drive_finish_s == pytest.approx((1.0, 1.5))
    assert s.efficiency == pytest.approx((4 / 3) / 1.5)
    # smallest first on drive 1: the 1 GB expert is ready at 0.5 s, the 2 GB one at 1.5 s
    assert [(r.expert, r.finish_s) for r in s.queues[1]] == [(1, pytest.approx(0.5)), (2, pytest.approx(1.5))]


def test_makespan_with_queue_and_latency():
    reqs = [ReadRequest(0, GB, replicas=(0,))]
    s = schedule_layer(reqs, [1.0, 1.0], queued_bytes=[GB, 0], latency_s=[0.001, 0.001])
    assert s.makespan_s == pytest.approx(2.001)
    assert s.ideal_s == pytest.approx(1.0)  # max(queued 1 GB at 1 GB/s, 2 GB over 2 GB/s)


def test_replica_choice_picks_less_loaded_drive():
    req = ReadRequest(7, GB, replicas=(0, 1))
    assert schedule_layer([req], [1.0, 1.0], queued_bytes=[5 * GB, 0]).drives_of(7) == [1]
    assert schedule_layer([req], [1.0, 1.0], queued_bytes=[0, 5 * GB]).drives_of(7) == [0]
    # same queue, faster drive wins
    assert schedule_layer([req], [1.0, 3.0]).drives_of(7) == [1]


def test_replicas_balance_a_layer_to_the_optimum():
    # sizes 3,3,2,2,2 GB on two equal drives: greedy alone gives 7 s, a swap reaches 6 s
    sizes = [3, 3, 2, 2, 2]
    reqs = [ReadRequest(e, n * GB, replicas=(0, 1)) for e, n in enumerate(sizes)]
    s = schedule_layer(reqs, [1.0, 1.0])
    assert s.makespan_s == pytest.approx(6.0)
    assert s.makespan_s == pytest.approx(s.ideal_s)


def test_bandwidth_striping_reaches_ideal_and_raid0_waits_for_slow_drive():
    rates = [6.0, 6.0, 6.0, 1.5]
    experts = list(range(16))
    sizes = [K3_EXPERT] * 16
    stripe = schedule_layer(layer_requests(experts, sizes, [], "stripe", rates), rates)
    raid0 = schedule_layer(layer_requests(experts, sizes, [], "raid0", rates), rates)
    assert stripe.makespan_s == pytest.approx(stripe.ideal_s, rel=0.01)
    assert raid0.makespan_s == pytest.approx(16 * K3_EXPERT / 4 / 1.5e9, rel=0.01)
    assert raid0.makespan_s > 2 * stripe.makespan_s


def test_striped_pieces_share_rank_on_every_drive():
    rates = [2.0, 1.0]
    reqs = [ReadRequest(e, n, pieces=stripe_bandwidth(n, rates)) for e, n in [(5, 8 * ALIGN), (3, 4 * ALIGN)]]
    s = schedule_layer(reqs, rates)
    assert [[r.expert for r in q] for q in s.queues] == [[3, 5], [3, 5]]
    assert sum(r.nbytes for q in s.queues for r in q) == 12 * ALIGN


def test_priority_comes_before_size():
    reqs = [ReadRequest(0, GB, replicas=(0,), priority=1), ReadRequest(1, 2 * GB, replicas=(0,), priority=0)]
    assert [r.expert for r in schedule_layer(reqs, [1.0]).queues[0]] == [1, 0]


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="either replicas"):
        ReadRequest(0, 10)
    with pytest.raises(ValueError, match="sum to"):
        ReadRequest(0, 10, pieces=(Piece(0, 0, 4),))
    with pytest.raises(ValueError, match="out of range"):
        schedule_layer([ReadRequest(0, 10, replicas=(3,))], [1.0])
    with pytest.raises(ValueError, match="unknown read layout"):
        layer_requests([0], [10], [[0]], "mirror")
