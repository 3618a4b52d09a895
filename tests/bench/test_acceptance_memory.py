"""bench/acceptance_memory.py: the pure parts (rates after a round, slot rates, scores)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.bench.loader import bench_script


@pytest.fixture(scope="module")
def memory() -> Iterator[ModuleType]:
    with bench_script("acceptance_memory") as module:
        yield module


def test_rates_after_a_miss_and_after_a_hit(memory: ModuleType) -> None:
    out = memory.after([[0, 2, 0, 0, 3, 1], [1, 0]])
    # after a miss: 2, 0, 3 (first request); none after the second's last round
    assert out["none"] == {
        "rounds": 3,
        "p_at_least_1": round(2 / 3, 4),
        "p_at_least_2": round(2 / 3, 4),
        "mean_accepted_cap3": round(5 / 3, 4),
    }
    # after a hit: 0 (after 2), 1 (after 3), 0 (after 1)
    assert out["one_or_more"]["rounds"] == 3
    assert out["one_or_more"]["p_at_least_1"] == round(1 / 3, 4)
    assert out["three_or_more"]["rounds"] == 1


def test_slot_rates_count_a_slot_only_where_every_slot_before_it_was_accepted(
    memory: ModuleType,
) -> None:
    # slot 0 reached by all 4 rounds, accepted in 3; slot 1 reached by 3, accepted in 2;
    # slot 2 reached by 2 (accepted 2 and 5), accepted in 1
    assert memory.slot_rates([[0, 1, 2], [5]]) == [3 / 4, 2 / 3, 1 / 2]


def geometric(rng: random.Random, p: float) -> int:
    n = 0
    while n < 15 and rng.random() < p:
        n += 1
    return n


def test_the_score_prefers_a_strong_prior_where_rounds_are_independent(
    memory: ModuleType,
) -> None:
    rng = random.Random(0)
    seqs = [[geometric(rng, 0.4) for _ in range(120)] for _ in range(8)]
    assert memory.brier(seqs, 0.98, 16.0) < memory.brier(seqs, 0.9, 1.0)


def test_the_score_prefers_a_short_memory_where_acceptance_comes_in_streaks(
    memory: ModuleType,
) -> None:
    rng = random.Random(0)
    # stretches of 20 rounds that accept nearly everything, then 20 that accept nearly nothing
    seqs = [
        [geometric(rng, 0.9 if (t // 20) % 2 == k % 2 else 0.05) for t in range(120)]
        for k in range(8)
    ]
    assert memory.brier(seqs, 0.8, 0.5) < memory.brier(seqs, 0.98, 16.0)


def test_scores_name_the_policys_constants_and_the_best(memory: ModuleType) -> None:
    rng = random.Random(1)
    seqs = [[geometric(rng, 0.3) for _ in range(40)] for _ in range(4)]
    out = memory.scores(seqs)
    (best,) = out["best"].values()
    (current,) = out["current"].values()
    assert best == min(out["grid"].values()) <= current
