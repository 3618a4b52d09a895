"""Suffix drafts: the continuation of the longest earlier match, in a request's own tokens and
in the served history, and the history's bounded memory."""

import pytest

from adaflash.config import EngineConfig
from adaflash.engine.suffix import GlobalSuffixes, Proposal, SuffixConfig, SuffixIndex, best

CFG = SuffixConfig(min_n=2, max_n=4, max_draft=6, global_tokens=40)


def test_the_longest_earlier_suffix_proposes_what_followed_it_latest():
    idx = SuffixIndex(CFG, [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    # it ends in 1 2 3: the latest earlier occurrence was followed by 4 5 6 7 8 …
    assert idx.propose(6) == Proposal((4, 5, 6, 7, 8, 1), 3)
    assert idx.propose(2) == Proposal((4, 5), 3)  # the limit
    idx.extend([5, 7])
    assert idx.propose(6) is None  # 5 7 never occurred before
    assert SuffixIndex(CFG, [2]).propose(6) is None  # shorter than min_n


def test_a_loop_is_drafted_from_its_own_last_turn():
    idx = SuffixIndex(CFG)
    loop = [10, 11, 12, 13]
    for t in loop * 3:
        idx.extend([t])
    got = idx.propose(6)  # the last turn, then the loop goes on with itself
    assert got == Proposal((10, 11, 12, 13, 10, 11), 4)


def test_the_current_suffix_does_not_match_itself():
    idx = SuffixIndex(CFG, [1, 2, 3, 4])
    assert idx.propose(6) is None  # 3 4 occurred only at the end


def test_the_history_proposes_across_sequences_and_forgets_the_oldest():
    hist = GlobalSuffixes(CFG)
    hist.add([1, 2, 3, 4, 5] * 2)  # 10 tokens
    assert hist.propose([7, 2, 3], 6) == Proposal((4, 5), 2)  # its latest: the end
    for i in range(4):  # 40 more tokens: the first sequence is evicted
        hist.add([100 + i] * 10)
    assert hist.size <= CFG.global_tokens
    assert hist.propose([7, 2, 3], 6) is None
    assert all(sid != 0 for sid, _ in hist.table.values())


def test_a_key_held_by_a_later_sequence_survives_the_eviction_of_an_earlier():
    hist = GlobalSuffixes(SuffixConfig(min_n=2, max_n=2, global_tokens=8))
    hist.add([1, 2, 3, 4])
    hist.add([1, 2, 7, 8])  # 1 2 now continues with 7
    hist.add([5, 6])  # 10 tokens: the first sequence leaves
    assert hist.propose([1, 2], 4) == Proposal((7, 8), 2)


def test_best_prefers_the_longer_match():
    a, b = Proposal((1,), 2), Proposal((2,), 3)
    assert best(a, None, b) == b and best(None) is None and best(a, Proposal((3,), 2)) == a


def test_config_refuses_bad_settings():
    with pytest.raises(ValueError, match="suffix"):
        EngineConfig(suffix="everyone")
    with pytest.raises(ValueError, match="min_n"):
        SuffixConfig(min_n=5, max_n=3)
