"""Accept/reject logic with fixed logits: always, never, sometimes."""

import torch

from adaflash.decoding.acceptance import argmax_rows, greedy_accept, sampled_accept

V = 10


def logits_for(tokens: list[int]) -> torch.Tensor:
    """Target logits whose argmax at row j is tokens[j]."""
    x = torch.zeros(len(tokens), V)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return x


def test_greedy_always_accepts_and_takes_bonus():
    acc = greedy_accept(logits_for([3, 4, 5, 6]), [3, 4, 5])
    assert (acc.accepted, acc.bonus_token, acc.accept_len) == (3, 6, 4)


def test_greedy_never_accepts():
    acc = greedy_accept(logits_for([3, 4, 5, 6]), [9, 4, 5])
    assert (acc.accepted, acc.bonus_token) == (0, 3)


def test_greedy_sometimes_accepts_and_corrects_at_first_mismatch():
    acc = greedy_accept(logits_for([3, 4, 5, 6]), [3, 4, 1])
    assert (acc.accepted, acc.bonus_token) == (2, 5)


def test_anchor_only_verification_is_plain_decoding():
    acc = greedy_accept(logits_for([7]), [])
    assert (acc.accepted, acc.bonus_token) == (0, 7)


def test_sampled_with_point_mass_target_behaves_like_greedy():
    g = torch.Generator().manual_seed(0)
    logits = logits_for([3, 4, 5, 6]) * 10  # near one-hot after softmax
    acc = sampled_accept(logits, [3, 4, 1], 1.0, 0, 1.0, g)
    assert (acc.accepted, acc.bonus_token) == (2, 5)


def test_sampled_acceptance_rate_equals_target_probability():
    """P(accept draft d) = p(d) for a point-mass drafter (min(1, p/q) with q = 1)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.3, 0.7] + [1e-9] * (V - 2), [0.5, 0.5] + [1e-9] * (V - 2)]))
    n, hits = 4000, 0
    for _ in range(n):
        hits += sampled_accept(logits, [0], 1.0, 0, 1.0, g).accepted
    assert abs(hits / n - 0.3) < 0.03


def test_argmax_rows_is_torchs_argmax_ties_and_nans_included():
    """NumPy's scan where it applies, torch's elsewhere: the first maximum, the first NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 49152, generator=g)
    x[1, 100] = x[1, 7] = x[1].max() + 1  # a tie: the first index wins
    x[2, 9] = x[2, 30] = float("nan")  # NaN beats every number
    x[3] = 0.0
    x[4, -1] = float("inf")
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        y = x.to(dtype)
        assert argmax_rows(y) == y.argmax(-1).tolist()
        assert argmax_rows(y[:, ::3]) == y[:, ::3].argmax(-1).tolist()  # strided rows
    assert argmax_rows(x)[1:3] == [7, 9]
    with torch.inference_mode():
        assert argmax_rows(x * 1) == x.argmax(-1).tolist()
