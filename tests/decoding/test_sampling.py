"""``sample_tokens`` draws from ``target_probs``'s distribution on every path: the candidates
(top-p and top-k among the largest logits), the race over the whole row, and the fallback for a
row whose candidates do not reach top-p (chi-square tests, fixed seeds: deterministic)."""

import pytest
import torch
from scipy.stats import chisquare

from adaflash.decoding import sampling
from adaflash.decoding.sampling import race, sample_tokens, target_probs

DRAWS = 20_000
V = 1000


def logits_of(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(V, generator=g)
    if kind == "peaked":  # as a language model's: a few tokens hold most of the mass
        x[:12] += torch.linspace(9, 5, 12)
    return x


def p_value(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() * len(draws)
    assert counts[expected == 0].sum() == 0, "a token outside the distribution was drawn"
    big = expected >= 5  # cells with fewer than 5 expected draws merged into one
    obs = [*counts[big].tolist(), float(counts[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


@pytest.mark.parametrize(
    ("kind", "temperature", "top_k", "top_p", "candidates"),
    [
        ("peaked", 0.7, 0, 0.9, 64),  # top-p among the candidates
        ("peaked", 1.0, 20, 1.0, 64),  # top-k among the candidates
        ("peaked", 1.0, 30, 0.8, 64),  # both
        ("peaked", 1.3, 0, 1.0, 64),  # no truncation: the race over the whole row
        ("flat", 1.0, 0, 0.9, 64),  # candidates short of top-p: the fallback
        ("flat", 1.0, 200, 0.95, 64),  # top-k beyond the candidates: the fallback
    ],
)
def test_draws_follow_target_probs(kind, temperature, top_k, top_p, candidates):
    x = logits_of(kind)[None].expand(DRAWS, -1)
    g = torch.Generator().manual_seed(7)
    draws = sample_tokens(x, temperature, top_k, top_p, g, candidates=candidates)
    want = target_probs(x[:1], temperature, top_k, top_p)[0]
    assert p_value(draws, want) > 1e-3


def test_the_test_has_power():
    """Draws at a slightly wrong temperature are rejected (top-k: the same support)."""
    x = logits_of("peaked")[None].expand(DRAWS, -1)
    draws = sample_tokens(x, 0.8, 30, 1.0, torch.Generator().manual_seed(7), candidates=64)
    assert p_value(draws, target_probs(x[:1], 0.7, 30, 1.0)[0]) < 1e-6


def test_rows_of_both_kinds_in_one_call_each_follow_their_own_distribution(monkeypatch):
    """A call whose rows are partly covered by the candidates and partly not takes the fallback
    for those alone; which path ran is seen through ``target_probs`` calls."""
    peaked, flat = logits_of("peaked"), logits_of("flat")
    x = torch.stack([peaked, flat] * (DRAWS // 2))
    calls = []
    real = sampling.target_probs
    monkeypatch.setattr(sampling, "target_probs", lambda *a: calls.append(1) or real(*a))
    draws = sample_tokens(x, 1.0, 0, 0.9, torch.Generator().manual_seed(3), candidates=64)
    assert len(calls) == DRAWS // 2  # the flat rows only
    for rows, logits in ((slice(0, None, 2), peaked), (slice(1, None, 2), flat)):
        assert p_value(draws[rows], real(logits[None], 1.0, 0, 0.9)[0]) > 1e-3


def test_seeded_draws_are_reproducible_and_the_top_token_survives_any_top_p():
    x = logits_of("peaked")[None].expand(64, -1)
    a = sample_tokens(x, 0.7, 0, 0.9, torch.Generator().manual_seed(5), candidates=64)
    b = sample_tokens(x, 0.7, 0, 0.9, torch.Generator().manual_seed(5), candidates=64)
    assert torch.equal(a, b)
    tiny = sample_tokens(x, 1.0, 0, 1e-30, torch.Generator().manual_seed(5), candidates=64)
    assert torch.all(tiny == int(x[0].argmax()))


def test_race_never_picks_an_excluded_index():
    scores = torch.tensor([[0.0, float("-inf"), -1.0, float("-inf")]]).expand(5000, -1)
    picks = race(scores, torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == {0, 2}
