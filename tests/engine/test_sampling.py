"""Under sampling, speculative output has the target's own distribution (a chi-square test).

The exact joint distribution of the first four tokens is computed from the target with the same
temperature/top-k/top-p processing; 3,000 speculative samples are compared with it. Tolerance:
the test fails when the chi-square p-value is below 1e-3 (seeds are fixed, so the outcome is
deterministic). A negative control shows the test has power: samples drawn at a slightly wrong
temperature are rejected with p < 1e-6.
"""

import pytest
import torch
from scipy.stats import chisquare

from adaflash.config import EngineConfig, SamplingParams
from adaflash.decoding import sampling
from adaflash.decoding.sampling import target_probs
from adaflash.engine.engine import Engine
from adaflash.models.target import PackedBatch
from tests.engine.conftest import random_drafter
from tests.engine.oracle import OracleEngine, PinnedCost, greedy_continuation

PROMPT = [7, 8, 9, 10]
N_TOKENS = 4
DRAWS = 3000


def exact_joint(target, prompt, temperature, top_k, top_p) -> dict[tuple[int, ...], float]:
    def probs(prefix: list[int]) -> torch.Tensor:
        cache = target.new_cache()
        slot = cache.allocate()
        logits = target(
            PackedBatch(torch.tensor(prefix), (slot,), (len(prefix),)), cache, logits="last"
        ).logits
        return target_probs(logits, temperature, top_k, top_p)[0]

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(N_TOKENS):
        nxt = {}
        for seq, p in joint.items():
            dist = probs(prompt + list(seq))
            for tok in dist.nonzero().flatten().tolist():
                nxt[(*seq, tok)] = p * float(dist[tok])
        joint = nxt
    return joint


def chi_square_p(samples: list[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> float:
    counts = {k: 0 for k in joint}
    for s in samples:
        counts[s] += 1
    keys = sorted(joint, key=joint.get, reverse=True)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k in keys:  # merge cells with fewer than 5 expected draws into one
        e = joint[k] * len(samples)
        if e >= 5:
            obs.append(counts[k])
            exp.append(e)
        else:
            rest_o += counts[k]
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def spec_samples(engine, temperature, top_k, top_p) -> list[tuple[int, ...]]:
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=N_TOKENS,
            ignore_eos=True,
            seed=i,
        )
        for i in range(DRAWS)
    ]
    results = engine.generate([PROMPT] * DRAWS, params)
    return [r.output_ids for r in results]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "drafter_kind", "policy", "candidates"),
    [
        (1.0, 3, 1.0, "oracle", "fixed", None),
        (0.7, 4, 0.9, "oracle", "fixed", None),
        (1.0, 3, 1.0, "random", "fixed", None),
        (1.0, 3, 1.0, "oracle", "cost", None),  # widths vary, k̂ = 0 (no draft) included
        # the tiny vocabulary (96) is below the candidates sorted by default (256), so these
        # take the candidates path of ``sample_tokens`` (its fallback for rows they miss)
        (0.3, 0, 0.8, "oracle", "fixed", 8),
        (1.0, 5, 0.8, "oracle", "cost", 8),
    ],
)
def test_speculative_sampling_matches_target_distribution(
    tiny, temperature, top_k, top_p, drafter_kind, policy, candidates, monkeypatch
):
    if candidates is not None:
        monkeypatch.setattr(sampling, "CANDIDATES", candidates)
    _, target, _ = tiny
    cfg = EngineConfig(policy=policy, max_running_requests=256, max_batch_tokens=4096)
    drafter = random_drafter(target)
    engine = (
        OracleEngine(
            target, drafter, cfg, continuation=greedy_continuation(target), corrupt_every=5
        )
        if drafter_kind == "oracle"
        else Engine(target, drafter, cfg)
    )
    if policy == "cost":
        engine.cost = PinnedCost()
    samples = spec_samples(engine, temperature, top_k, top_p)
    joint = exact_joint(target, PROMPT, temperature, top_k, top_p)
    p = chi_square_p(samples, joint)
    assert p > 1e-3, f"speculative samples deviate from the target (p = {p:.2e})"
    if drafter_kind == "oracle":
        # drafts were both accepted and rejected
        assert 0.1 * engine.counters.verified < engine.counters.accepted
        assert engine.counters.accepted < engine.counters.verified
    if policy == "cost":  # some rounds verified drafts, others were plain steps (k̂ = 0)
        assert 0 < engine.counters.slot_verified[0] < engine.counters.rounds


def test_chi_square_detects_a_wrong_distribution(tiny_llama):
    """Negative control: sampling at T=1.4 while expecting T=1.0 must be rejected."""
    _, target, _ = tiny_llama
    engine = Engine(
        target,
        random_drafter(target),
        EngineConfig(policy="fixed", max_running_requests=256, max_batch_tokens=4096),
    )
    samples = spec_samples(engine, 1.4, 3, 1.0)
    joint = exact_joint(target, PROMPT, 1.0, 3, 1.0)
    assert chi_square_p(samples, joint) < 1e-6


def test_top_k_top_p_processing():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = target_probs(logits, 1.0, top_k=2)
    assert p[0, 2:].sum() == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)[0]
    p = target_probs(logits, 1.0, top_p=float(full[0]) + 1e-4)  # needs the top two tokens
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    p = target_probs(logits, 1.0, top_p=float(full[0]) - 1e-4)  # the top token suffices
    assert (p[0] > 0).tolist() == [True, False, False, False, False]
