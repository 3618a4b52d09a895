from adaflash.metrics import SpecCounters, probe_buckets, speedup


def test_counters_and_derived_rates():
    c = SpecCounters(block_size=4)
    c.add_round(verify_len=4, accepted=3, drafted=3)  # all accepted: τ = 4
    c.add_round(verify_len=2, accepted=0, drafted=3)  # one verified, rejected: τ = 1
    assert c.rounds == 2 and c.verified == 4 and c.accepted == 3
    assert c.accept_len == (3 + 2) / 2
    assert c.verify_len == (4 + 2) / 2
    assert c.acceptance_rate == 3 / 4
    assert c.slot_acceptance == [0.5, 1.0, 1.0]


def test_window_is_difference_of_snapshots():
    c = SpecCounters(block_size=4)
    c.add_round(4, 3, 3)
    before = c.copy()
    c.add_round(2, 1, 3)
    w = c - before
    assert w.rounds == 1 and w.accept_len == 2.0 and w.slot_acceptance == [1.0, None, None]
    assert (before + w).accepted == c.accepted


def test_speedup_ratio():
    assert speedup(30.0, 20.0) == 1.5 and speedup(1.0, 0.0) == 0.0


def test_probe_buckets_count_each_probe_as_the_round_it_stands_for():
    # (unix time, slots compared, accepted): two probes in the 10 s bucket at 100, one at 120
    probes = [(101.0, 4, 3), (109.9, 15, 15), (125.0, 2, 0)]
    first, second = probe_buckets(probes, 16, 10)
    assert (first.start, second.start) == (100.0, 120.0)
    assert first.counters.rounds == 2 and first.counters.verified == 19
    assert first.counters.accept_len == (2 + 18) / 2  # τ had each whole block been verified
    assert second.counters.accept_len == 1.0 and second.tokens_per_s == 0.0
    assert probe_buckets([], 16, 10) == []
