"""The online cost model learns a machine's costs; the cost policy decides with them."""

import random
from dataclasses import replace

import pytest
import torch

from adaflash.config import SamplingParams
from adaflash.cost_model import PLAIN_REFRESH, CostModel, RecursiveLeastSquares
from adaflash.engine import policy as policy_module
from adaflash.engine.policy import (
    PROBE_REQUESTS,
    PROBE_SHARE,
    PROBE_START_S,
    CostPolicy,
    PolicyContext,
    batch_gain,
    freed_value,
    probe_outcome,
    queue_gain,
    work_end,
)
from adaflash.engine.request import Request


def test_recursive_least_squares_recovers_and_follows_costs():
    cost = CostModel()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # a machine where a pass costs 30 ms + 1 ms/token + 2 ms/request
        tokens, reqs = int(torch.randint(1, 64, (1,), generator=g)), int(torch.randint(1, 9, (1,)))
        cost.observe_target(tokens, reqs, 0.030 + 0.001 * tokens + 0.002 * reqs)
        cost.observe_drafter(reqs, 0.010 + 0.003 * reqs)
    assert abs(cost.target_s(10, 2) - 0.044) < 1e-3
    assert abs(cost.drafter_s(4) - 0.022) < 1e-3
    for _ in range(200):  # then another process takes half the cores: everything doubles
        tokens = int(torch.randint(1, 64, (1,), generator=g))
        cost.observe_target(tokens, 2, 2 * (0.030 + 0.001 * tokens + 0.004))
    assert abs(cost.target_s(10, 2) - 0.088) < 3e-3


def test_a_few_drafter_passes_never_price_more_requests_cheaper():
    """A serving run's first drafter passes (traced on a Zen 4 at C = 16): one or two requests
    with long contexts to catch up, one of them slow. An unconstrained fit of those four put
    −20 ms on each request, and priced a pass of 16 requests at nothing; the drafter's fit keeps
    every part's cost ≥ 0, so more requests never cost less."""
    passes = [(1, 314, 0.0076), (1, 167, 0.0684), (2, 92, 0.0087), (2, 481, 0.0251)]
    free = RecursiveLeastSquares([0.01, 0.002, 0.0001])
    cost = CostModel()
    for n, ctx, seconds in passes:
        free.update([1.0, n, ctx], seconds)
        cost.observe_drafter(n, seconds, ctx)
    assert free.predict([1.0, 16, 100]) < 0  # what the unconstrained fit said
    assert min(cost.drafter.theta) >= 0.0
    assert cost.drafter_s(16, 100) >= cost.drafter_s(2, 100) >= cost.drafter_s(1, 100) > 0


def test_the_drafter_fit_keeps_its_prior_ratio_where_passes_never_varied():
    """A cost engine's first drafter passes are one-request probes (times of a Zen 5 trace,
    milliseconds), so requests and positions are not identified: priced with P = c·I, an 8-request
    pass catching up 813 positions (measured 16.4 ms) came out 0.4–3.9× that depending only on
    the order of the same six passes; with the relative prior, the same in every order and near
    what it took."""
    passes = [(1, 1, 3.6), (1, 1, 4.0), (1, 1, 4.2), (1, 129, 5.7), (1, 60, 5.0), (1, 1, 3.8)]
    rng = random.Random(0)
    flat, relative = [], []
    for _ in range(20):
        rng.shuffle(passes)
        old = RecursiveLeastSquares([0.01, 0.002, 0.0001], nonnegative=True)
        cost = CostModel()
        for n, ctx, ms in passes:
            old.update([1.0, n, ctx], ms / 1e3)
            cost.observe_drafter(n, ms / 1e3, ctx)
        flat.append(old.predict([1.0, 8, 813]) / 0.0164)
        relative.append(cost.drafter_s(8, 813) / 0.0164)
    assert max(flat) / min(flat) > 3  # what the flat prior did
    assert max(relative) / min(relative) < 1.05
    assert min(relative) > 0.5 and max(relative) < 2.0


def test_thousands_of_one_request_drafter_passes_keep_the_fit_sound():
    """One-request passes never vary base against per request, so with plain exponential
    forgetting the fit's covariance grew by 1/λ an update along that direction until its float
    arithmetic broke (~3,000 passes: a server probing one request at a time for about a day;
    a one-request pass then priced 43.7 ms against 12.5). Forgetting towards the prior keeps
    it sound, and a machine that turns 2× slower is still followed within ~60 passes."""
    rng = random.Random(1)
    cost = CostModel()
    for _ in range(3000):
        ctx = rng.randint(1, 150)
        cost.observe_drafter(1, (10 + 0.05 * ctx + rng.gauss(0, 0.5)) / 1e3, ctx)
    assert all(cost.drafter.p[i][i] > 0 for i in range(3))
    assert abs(cost.drafter_s(1, 50) - 0.0125) < 0.001
    for _ in range(60):  # now twice as slow
        ctx = rng.randint(1, 150)
        cost.observe_drafter(1, 2 * (10 + 0.05 * ctx + rng.gauss(0, 0.5)) / 1e3, ctx)
    assert cost.drafter_s(1, 50) > 0.022


def req(i: int) -> Request:
    r = Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=64))
    r.output_ids = [5]
    r.prefilled = 3
    return r


def test_a_requests_profile_estimates_each_slots_acceptance_after_the_one_before():
    """Each slot accepted 70% of the time once the slot before it was (until the first miss):
    the planned survival of slot i is 0.7^i, for the request and engine-wide, whatever the
    verified width was (a round that missed at slot 2 says nothing about slot 5)."""
    k = 8
    policy = CostPolicy(k)
    r = req(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        accepted = int((torch.rand(k - 1, generator=g) < 0.7).cumprod(0).sum())
        policy.observe(r, k, accepted, k)
    conditional = [ok / seen for ok, seen in zip(policy.ok, policy.seen, strict=True)]
    assert all(abs(a - 0.7) < 0.06 for a in conditional[:4]), conditional
    survival = policy.survival(req(1), k)  # a new request: the engine-wide profile
    assert all(abs(s - 0.7 ** (i + 1)) < 0.15 * 0.7 ** (i + 1) for i, s in enumerate(survival[:4]))
    mine = policy.survival(r, k)  # its own: its last ~20 rounds, so only roughly
    assert 0.4 < mine[0] < 0.95 and mine[3] < mine[2] < mine[1] < mine[0]
    # what a planned step expects: the bonus token plus each verified slot's survival
    cost = CostModel()
    for n in range(1, 20):  # verifying is nearly free next to a step's base cost
        cost.observe_target(n, 1, 0.040 + 0.0005 * n)
        cost.observe_drafter(1, 0.005)
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    new = req(2)
    assert policy.drafters([new], ctx) == [new]
    w = int(policy.widths([new], None, ctx)[0])
    assert w > 2 and policy.expected_tokens == 1 + sum(survival[: w - 1])


def test_survival_is_kept_between_steps_and_follows_every_round_and_probe():
    """A request's survival is computed once per state of the policy's profiles: a plain round
    changes nothing; any verified round or probe — its own or another request's, which moves
    the engine-wide profile — makes every request's survival be computed afresh."""
    k = 6
    policy = CostPolicy(k)
    mine, other = req(0), req(1)

    def fresh(r: Request) -> list[float]:
        r.survival = None  # what it is, computed now
        return policy.survival(r, k)

    first = policy.survival(other, k)
    kept = other.survival
    policy.observe(mine, 1, 0, k)  # a plain round measures nothing: what was kept holds
    assert policy.survival(other, k) == first and other.survival is kept is not None
    policy.observe(mine, k, 3, k)  # another request's round: the engine-wide profile moves
    moved = policy.survival(other, k)
    assert moved != first and moved == fresh(other)
    policy.observe_probe(other, 4, 4, k)  # its own probe
    assert policy.survival(other, k) == fresh(other) != moved


def test_cost_policy_drafts_only_when_it_pays():
    k = 8
    cost = CostModel()
    for n in range(1, 40):  # verifying is nearly free next to a step's base cost
        cost.observe_target(n, 1, 0.040 + 0.0005 * n)
        cost.observe_drafter(1, 0.010)
    policy, useless = CostPolicy(k), CostPolicy(k)  # a drafter that is good, one that is not
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    good, bad = req(0), req(1)
    g = torch.Generator().manual_seed(0)  # unseeded, a run of 2s now and then failed it
    for _ in range(20):  # good's drafts are accepted 90% per slot, bad's never
        policy.observe(good, k, 7 if torch.rand(1, generator=g) < 0.9**7 else 2, k)
        useless.observe(bad, k, 0, k)
    assert policy.drafters([good], ctx) == [good]
    widths = policy.widths([good], None, ctx)
    assert int(widths[0]) >= 4  # cheap tokens, likely accepted: verify many
    assert useless.drafters([bad], ctx) == []  # a drafter pass that yields nothing
    # when drafting is expensive, even the good request takes a plain step
    pricey = CostModel()
    for n in range(1, 40):
        pricey.observe_target(n, 1, 0.040 + 0.0005 * n)
        pricey.observe_drafter(1, 0.200)
    assert policy.drafters([good], PolicyContext(k, 1.0, pricey, 512, 0)) == []


def test_the_drafters_bound_skips_only_plans_that_cannot_win(monkeypatch):
    """``drafters`` skips a subset's plan when even its bound loses; it chooses exactly what
    planning every subset would, and plans nothing for a drafter that does not pay."""
    k, g = 16, torch.Generator().manual_seed(3)
    for trial in range(200):
        n_req = 1 + trial % 8
        cost = CostModel()
        base, per_tok = 0.005 + 0.02 * float(torch.rand(1, generator=g)), 0.0004
        for n in range(n_req, n_req + 60):
            cost.observe_target(n, n_req, base + per_tok * n)
            cost.observe_drafter(n_req, 0.001 + 0.01 * float(torch.rand(1, generator=g)))
        policy = CostPolicy(k, probe_every=10**6)  # no probes: the choice alone
        reqs = [req(i) for i in range(n_req)]
        for r in reqs:  # per request: a drafter anywhere from useless to good
            q = float(torch.rand(1, generator=g))
            for _ in range(12):
                policy.observe(r, k, int((k - 1) * q * float(torch.rand(1, generator=g))), k)
        # every other trial with a request queued: drafted tokens then count in full
        ctx = PolicyContext(k, 1.0, cost, budget=16 * n_req, other_tokens=0, waiting=trial % 2)
        # the reference: plan every prefix of the same order, keep the best (plain if none wins)
        policy.freed = freed_value(n_req, ctx)
        surv = {id(r): policy.survival(r, k) for r in reqs}
        order = sorted(reqs, key=lambda r: -sum(surv[id(r)]))
        best_n, best = 0, n_req / cost.target_s(n_req, n_req)
        for n in range(1, n_req + 1):
            rate, _ = policy.plan(order[:n], ctx, n_req - n, surv)
            if rate > best:
                best_n, best = n, rate
        assert policy.drafters(reqs, ctx) == order[:best_n], trial
    # a drafter that never lands a token: the bound rules out every plan
    policy = CostPolicy(k, probe_every=10**6)
    reqs = [req(i) for i in range(16)]
    for r in reqs:
        for _ in range(30):
            policy.observe(r, k, 0, k)
    planned, charged = [], []
    monkeypatch.setattr(CostPolicy, "plan", lambda *a, **kw: planned.append(1) or (0.0, {}))
    real_charged = policy_module.charged
    monkeypatch.setattr(policy_module, "charged", lambda *a: charged.append(1) or real_charged(*a))
    ctx = PolicyContext(k, 1.0, plain_cost(), budget=256, other_tokens=0)
    assert policy.drafters(reqs, ctx) == [] and planned == []
    assert charged == []  # … all subsets at once: not even a request's context is charged


def test_a_declined_plan_stands_while_nothing_it_was_made_from_changes(monkeypatch):
    """A drafter that looks good where drafting does not pay: its subsets are planned once, and
    the plain step stands for the next ``REPLAN_EVERY`` − 1 steps while the profiles, the
    requests and the pass stay as they were; a profile that changes is planned again at once."""
    monkeypatch.setattr(policy_module, "PROBE_START_S", 0.0)  # no probes: the plans alone
    k = 16
    cost, policy, reqs = drafting_eight(0.060)  # 80% a slot, but width 4 costs 3 plain steps
    real_plan, planned = CostPolicy.plan, []
    monkeypatch.setattr(
        CostPolicy, "plan", lambda *a, **kw: planned.append(1) or real_plan(*a, **kw)
    )
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    assert policy.drafters(reqs, ctx) == [] and policy.standing is not None
    per_step = len(planned)  # the plans of one decision
    assert per_step >= 1
    for _ in range(3 * policy_module.REPLAN_EVERY - 1):
        assert policy.drafters(reqs, ctx) == []
    assert len(planned) == 3 * per_step
    policy.observe(reqs[0], k, 0, k)  # a profile changed: planned again at once
    policy.drafters(reqs, ctx)
    assert len(planned) == 4 * per_step


def test_a_plain_step_that_no_plan_could_beat_stands_too(monkeypatch):
    """A drafter that does not pay: once the bound has ruled out every plan, the next
    ``REPLAN_EVERY`` − 1 steps look at no request's expectations, while the profiles, the
    requests and the pass stay as they were; a new request in the pass decides again."""
    monkeypatch.setattr(policy_module, "PROBE_START_S", 0.0)  # no probes: the choice alone
    k = 16
    policy = CostPolicy(k)
    reqs = [req(i) for i in range(8)]
    for r in reqs:
        for _ in range(30):
            policy.observe(r, k, 0, k)
    looked = []
    real = CostPolicy.expected_drafts
    monkeypatch.setattr(CostPolicy, "expected_drafts", lambda *a: looked.append(1) or real(*a))
    ctx = PolicyContext(k, 1.0, plain_cost(), budget=256, other_tokens=0)
    assert policy.drafters(reqs, ctx) == [] and len(looked) == len(reqs)
    for _ in range(policy_module.REPLAN_EVERY - 1):
        assert policy.drafters(reqs, ctx) == [] and policy.predicted_s == ctx.cost.target_s(8, 8)
    assert len(looked) == len(reqs)
    policy.drafters(reqs, ctx)  # it stood its steps: decided again
    assert len(looked) == 2 * len(reqs)
    policy.drafters([*reqs, req(8)], ctx)  # one request more: decided again at once
    assert len(looked) == 2 * len(reqs) + len(reqs) + 1


def test_drafter_cost_learns_context_catch_up_and_the_policy_prices_it():
    cost = CostModel()
    g = torch.Generator().manual_seed(1)
    for _ in range(200):  # 8 ms + 2 ms/request + 0.1 ms per context position projected
        reqs = int(torch.randint(1, 9, (1,), generator=g))
        ctx_tokens = int(torch.randint(0, 400, (1,), generator=g))
        cost.observe_drafter(reqs, 0.008 + 0.002 * reqs + 0.0001 * ctx_tokens, ctx_tokens)
        cost.observe_target(ctx_tokens % 64 + 1, reqs, 0.040 + 0.0005 * (ctx_tokens % 64 + 1))
    assert abs(cost.drafter_s(2, 100) - 0.022) < 1e-3
    assert cost.snapshot()["drafter_per_context_token_ms"] > 0.05
    k = 8
    policy = CostPolicy(k)
    r = req(0)
    for _ in range(20):  # drafts accepted about half the time per slot
        policy.observe(r, k, 1, k)
    near = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0, pending=lambda _: 1)
    far = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0, pending=lambda _: 600)
    assert policy.drafters([r], near) == [r]  # drafting pays when it is caught up …
    # … and with 600 positions to catch up first (70 ms, nearly two steps), while that backlog
    # is spread over the 63 tokens it has left: once caught up, it drafts on without it …
    assert r.tokens_left == 63 and policy.drafters([r], far) == [r]
    assert policy.draft_s > cost.drafter_s(1, 600) - 1e-9  # (priced in full as predicted)
    r.output_ids += [5] * 61  # … but not for the 2 tokens a request has left
    assert policy.drafters([r], far) == []


def plain_cost() -> CostModel:
    cost = CostModel()
    for n in range(1, 40):  # a drafter pass costs as much as a target step: rarely worth it
        cost.observe_target(n, 1, 0.040 + 0.0005 * n)
        cost.observe_drafter(1, 0.040)
    return cost


def test_failed_probes_back_off_for_the_drafter_and_new_requests_inherit_the_gap(monkeypatch):
    monkeypatch.setattr(policy_module, "PROBE_START_S", 1e9)  # the gap alone paces probes
    k = 8
    policy = CostPolicy(k, probe_every=4)
    ctx = PolicyContext(k, 1.0, plain_cost(), budget=512, other_tokens=0)
    r = req(0)
    for _ in range(30):  # the drafter never gets anything right: profile says do not draft
        policy.observe(r, k, 0, k)
    probes = 0
    for rnd in range(1, 200):
        r.rounds = rnd
        assert policy.drafters([r], ctx) == []  # nothing verified: a probe is a shadow draft
        if policy.probes == [r]:  # its first draft missed
            probes += 1
            policy.observe_probe(r, 1, 0, k)
    assert 3 <= probes <= 6  # gaps 4, 8, 16, 32, 64, 128: backing off, not every 4 rounds
    late = req(1)  # a request that arrives now starts from the drafter's long gap
    late.rounds = 40
    assert policy.drafters([late], ctx) == [] and policy.probes == []
    policy.reset()  # a new drafter version: probe soon again
    assert policy.probe_gap == 4


def test_a_shadow_draft_is_answered_by_the_tokens_committed_after_it():
    """A probe's drafts stand for the tokens the request commits next: matched up to the first
    miss is what verifying them would have accepted; undecided until a miss, the whole block
    matched, or the request's end."""
    r = req(0)  # output [5]: the probe drafted at anchor 5 for output indices 1, 2, 3
    r.shadow = (1, [7, 8, 9])
    assert probe_outcome(r) is None  # nothing committed since
    r.output_ids += [7]
    assert probe_outcome(r) is None  # right so far
    r.output_ids += [8, 4]
    assert probe_outcome(r) == (3, 2)  # a miss at the third draft: two accepted
    r.output_ids = [5, 4, 8, 9]
    assert probe_outcome(r) == (1, 0)  # a miss at the first (later agreement counts for nothing)
    r.output_ids = [5, 7, 8, 9, 1]
    assert probe_outcome(r) == (3, 3)  # the whole block
    r.output_ids, r.finish_reason = [5, 7], "length"
    assert probe_outcome(r) == (1, 1)  # the request ended after one token, which matched


def test_the_lone_probe_waits_for_the_gap_and_goes_to_the_least_context_to_catch_up(monkeypatch):
    monkeypatch.setattr(policy_module, "PROBE_START_S", 1e9)  # a pass of PROBE_REQUESTS
    k = 8
    policy = CostPolicy(k, probe_every=4)
    a, b = req(0), req(1)
    for r in (a, b):
        for _ in range(30):
            policy.observe(r, k, 0, k)
        r.rounds = 10
    pending = {id(a): 300, id(b): 20}
    ctx = PolicyContext(
        k, 1.0, plain_cost(), budget=512, other_tokens=0, pending=lambda r: pending[id(r)]
    )
    probes = []
    for _ in range(4):  # at once (a new drafter is probed before anything is bet on it) …
        assert policy.drafters([a, b], ctx) == []
        probes.append(list(policy.probes))
    assert probes == [[b, a], [], [], []]  # … cheapest first; then the gap
    policy.probe_budget_s = 1e-3  # a budget for one probe more: the cheapest gets it
    assert policy.drafters([a, b], ctx) == [] and policy.probes == [b]
    b.shadow = (1, [7])  # while b's shadow draft awaits its answer, b is not probed again
    policy.idle_steps, policy.probe_budget_s = policy.probe_gap, 1e-3
    assert policy.drafters([a, b], ctx) == [] and policy.probes == [a]


def test_a_pass_of_probes_that_all_find_nothing_backs_off_once(monkeypatch):
    monkeypatch.setattr(policy_module, "PROBE_START_S", 1e9)  # a pass of PROBE_REQUESTS
    k = 8
    policy = CostPolicy(k, probe_every=4)
    ctx = PolicyContext(k, 1.0, plain_cost(), budget=512, other_tokens=0)
    reqs = [req(i) for i in range(6)]
    assert policy.drafters(reqs, ctx) == []
    probes = list(policy.probes)
    assert 2 <= len(probes) <= PROBE_REQUESTS
    for r in probes:
        policy.observe_probe(r, 1, 0, k)
    assert policy.probe_gap == 8  # doubled once, not once per probe
    assert all(r.probe_gap == 8 for r in probes)  # each request's own gap doubled too


def lone_probe_share(
    drafter_s: float, steps: int = 20_000, found: bool = False
) -> tuple[float, int, float]:
    """(probe time ÷ serving time, probes, one probe's seconds) over ``steps`` plain steps of
    10 ms, every probe finding nothing (``found``: its whole block, where drafting still does
    not pay: the policy must never draft)."""
    k = 8
    cost = CostModel()
    for n in range(1, 40):
        cost.observe_target(n, 1, 0.010 + 0.0005 * n)
        cost.observe_drafter(1, drafter_s)
    policy = CostPolicy(k, probe_every=4)
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    r = req(0)
    plain_s = cost.target_s(1, 1)
    probe_s = cost.drafter_s(1)  # a probe: a drafter pass beside the plain step
    probes = 0
    for rnd in range(steps):
        r.rounds = rnd
        assert policy.drafters([r], ctx) == []
        if policy.probes:
            probes += 1
            if found:
                policy.observe_probe(r, k - 1, k - 1, k)
            else:
                policy.observe_probe(r, 1, 0, k)
    return probes * probe_s / (steps * plain_s), probes, probe_s


def test_lone_probes_cost_at_most_their_share_of_serving_time(monkeypatch):
    """Compiled plain steps are cheap next to a probe's drafter pass: the gap alone (at most
    256 steps) lets probes take several percent of the time; the budget holds them to
    PROBE_SHARE, after the start's PROBE_START_S and one probe of debt — also when one probe
    costs more than the budget's cap — and the share backs off with the gap while probes keep
    finding nothing."""
    serving = 20_000 * 0.0105
    for drafter_s in (0.02, 0.2, 0.6):  # 0.2 and 0.6 s: more than PROBE_START_S
        share, probes, probe_s = lone_probe_share(drafter_s)
        assert share <= PROBE_SHARE + (PROBE_START_S + probe_s) / serving
        assert probes >= 1  # the start's
    share, probes, _ = lone_probe_share(0.02)
    assert probes >= 3  # still probing: a drafter that turns good is noticed
    assert share < PROBE_SHARE / 4  # … at a share that fell with the gap (32× at 128 steps)
    monkeypatch.setattr(policy_module, "PROBE_START_S", 1e9)  # no budget: the gap alone
    share, _, _ = lone_probe_share(0.2)
    assert share > 4 * PROBE_SHARE


def test_a_good_drafter_that_does_not_pay_is_probed_no_more_than_one_that_finds_nothing():
    """A drafter whose every draft is right but whose pass costs more than what it saves (a
    0.2 or 0.6 s pass against 10 ms plain steps): once a request's probe has measured that, its
    next ones find what was known and pay nothing back, so probes keep to the same share of
    serving time as those of a drafter that finds nothing (judged against the engine-wide
    profile, which climbs from a = 0 as n/(n+1), 12 and 7 such probes: 1.1% and 2.0% of the
    time, against 3 and 2 now: 0.29% and 0.57%)."""
    serving = 20_000 * 0.0105
    for drafter_s in (0.2, 0.6):
        share, probes, probe_s = lone_probe_share(drafter_s, found=True)
        assert 1 <= probes <= 4, probes
        assert share <= PROBE_SHARE + (PROBE_START_S + 2 * probe_s) / serving


def test_a_probe_pays_back_the_share_of_its_cost_that_its_drafts_found():
    """A probe is paid back by what its drafts found beyond what was known of its request (its
    own measured slot rates here: all 7 of 7 where it expected none, all of it; none, nothing),
    so a drafter that turned good keeps being probed until its profile says draft; such a probe
    halves the drafter-wide gap rather than resetting it, and one that finds what the profile
    expected doubles it, so a drafter known to land a token now and then stays rarely probed."""
    k = 8
    ctx = PolicyContext(k, 1.0, plain_cost(), budget=512, other_tokens=0)
    cases = [(0, 0.0, 128, 0), (3, 3 / 7, 32, 0), (7, 1.0, 32, 0), (1, 0.0, 128, 1)]
    for accepted, refund, gap, known in cases:  # known: the drafts every round accepted
        policy = CostPolicy(k, probe_every=4)
        policy.probe_gap = policy.idle_steps = 64  # a drafter probed rarely by now
        r = req(0)
        for _ in range(30):
            policy.observe(r, k, known, k)
        assert policy.expected_accepted(r, k)[k - 2] == pytest.approx(known, abs=0.05)
        assert policy.drafters([r], ctx) == [] and policy.probes == [r]
        spent = policy.launched[id(r)][2]  # a drafter pass: more than the start's budget
        assert spent > PROBE_START_S
        assert policy.probe_budget_s == pytest.approx(PROBE_START_S - spent)
        policy.observe_probe(r, k - 1, accepted, k)
        assert policy.probe_budget_s == pytest.approx(PROBE_START_S - spent + refund * spent)
        assert policy.probe_gap == gap


def test_probes_that_ride_along_spend_the_budget_they_add():
    """One request drafts in a step of 16 and the 15 others are due a probe: each that joins
    adds a request to the drafter pass (not to the target pass: a shadow draft is not
    verified), so they join while the budget lasts, not all at once; with the budget spent,
    only the request that pays drafts."""
    k, n = 8, 16
    cost = CostModel()
    for _ in range(10):
        cost.observe_target(n, n, 0.200)  # a plain step of 16
        for extra in (1, 8, 32, 48):  # a mixed pass: 2 ms per verified token
            cost.observe_target(n + extra, n, 0.200 + 0.002 * extra)
        for d in (1, 4, 16):
            cost.observe_drafter(d, 0.010 + 0.020 * d)  # 20 ms a request
    policy = CostPolicy(k, probe_every=4)
    # a request queued: the good one's drafts count in full (``freed_value``)
    ctx = PolicyContext(k, 1.0, cost, budget=16 * n, other_tokens=0, waiting=1)
    good, others = req(0), [req(i) for i in range(1, n)]
    for _ in range(20):
        policy.observe(good, k, k - 1, k)  # everything accepted: drafting it pays
    for r in others:
        for _ in range(10):  # their drafts failed: drafting them does not pay …
            policy.observe(r, 4, 0, k)
        r.rounds = 20  # … and it was a while ago: every one is due a probe
    assert policy.drafters([good, *others], ctx) == [good]
    riders = list(policy.probes)
    assert 2 <= len(riders) <= PROBE_START_S / 0.020 + 1 < len(others), len(riders)
    assert good not in riders
    assert policy.probe_budget_s <= 0
    assert policy.draft_s >= cost.drafter_s(1 + len(riders))  # the pass they ride in
    for r in riders:  # their probes found nothing
        policy.observe_probe(r, 1, 0, k)
    assert policy.drafters([good, *others], ctx) == [good]
    assert policy.probes == []  # the rest wait for the budget


def test_a_new_drafter_version_is_probed_at_once_again():
    k = 8
    policy = CostPolicy(k, probe_every=4)
    ctx = PolicyContext(k, 1.0, plain_cost(), budget=512, other_tokens=0)
    r = req(0)
    for rnd in range(2000):  # probes that find nothing: the gap and the budget run down
        r.rounds = rnd
        policy.drafters([r], ctx)
        if policy.probes:
            policy.observe_probe(r, 1, 0, k)
    policy.drafters([r], ctx)
    assert policy.probes == []  # backed off
    policy.reset()
    r.rounds += 1
    policy.drafters([r], ctx)
    assert policy.probes == [r]  # at the first step


def test_short_lived_requests_still_probe_and_a_good_drafter_is_noticed():
    """Replies shorter than the probe gap never reach it by their own rounds; the drafter-wide
    idle clock probes them anyway, and accepted probes lift the engine-wide profile until
    drafting pays without probing."""
    k = 8
    cost = CostModel()
    for n in range(1, 40):  # verifying is nearly free next to a step's base cost
        cost.observe_target(n, 1, 0.040 + 0.0005 * n)
        cost.observe_drafter(1, 0.020)
    policy = CostPolicy(k, probe_every=4)
    for _ in range(40):  # the engine-wide profile says: this drafter finds nothing
        policy.observe(req(99), k, 0, k)
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    drafted, probes = [], 0
    for step in range(300):  # a new one-round request every step
        r = req(step)
        chosen = policy.drafters([r], ctx)
        if policy.probes:  # the drafter has become perfect: its whole block matches …
            probes += 1
            policy.observe_probe(r, k - 1, k - 1, k)
        if chosen:  # … and everything verified is accepted
            w = int(policy.widths(chosen, None, ctx)[0])
            policy.observe(r, w, w - 1, k)
        drafted.append(bool(chosen))
    assert probes >= 1
    assert all(drafted[-10:])  # noticed: every request drafts, no probe needed


def profiled_request(k: int, seed: int = 0) -> tuple[CostPolicy, Request]:
    """A cost policy and one request whose slots were each accepted 70% of the time, up to the
    first miss, over 40 rounds."""
    policy, r = CostPolicy(k), req(0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        policy.observe(r, k, int((torch.rand(k - 1, generator=g) < 0.7).cumprod(0).sum()), k)
    return policy, r


def observe_one_request_chunks(cost: CostModel) -> None:
    """Eager prompt chunks of one request, 40–280 tokens: 35 ms + 0.3 ms a token."""
    for n in range(40, 300, 20):
        cost.observe_target(n, 1, 0.035 + 0.0003 * n, prefill=True)


def test_one_request_passes_get_their_own_costs_and_the_policy_stays_on_the_cheap_side():
    """A compiled graph makes a one-request pass of ≤ 4 tokens cheap and the fifth token costs
    the eager path: the table sees the jump that one line through all passes would smear."""
    k = 8
    cost = CostModel()
    one = {1: 0.012, 2: 0.014, 3: 0.015, 4: 0.016, 8: 0.045}  # compiled up to 4, eager beyond
    for _ in range(30):
        for n, t in one.items():
            cost.observe_target(n, 1, t)
        for reqs in (2, 4, 8):  # plain batched passes: a table of their own
            cost.observe_target(reqs, reqs, 0.030 + 0.002 * reqs)
        cost.observe_drafter(1, 0.004)
    assert abs(cost.target_s(4, 1) - 0.016) < 1e-6
    assert abs(cost.target_s(6, 1) - (0.016 + 0.029 / 2)) < 1e-6  # between the measured 4 and 8
    assert cost.target_s(12, 1) >= 0.045  # above the largest measured: never cheaper than it
    assert abs(cost.target_s(4, 4) - 0.038) < 2e-3  # plain batched passes: their own table
    assert cost.snapshot()["target_1req_4tok_ms"] == 16.0
    policy, r = profiled_request(k)
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    assert policy.drafters([r], ctx) == [r]
    assert int(policy.widths([r], None, ctx)[0]) == 4  # the widest compiled width, not eager


def test_a_one_request_verification_is_priced_by_its_compiled_width_and_tried_once_cold():
    """One request verifying n tokens runs on the smallest compiled width ≥ n: every count
    that pads to it costs what that graph costs. Untimed, it is priced as the one-token step
    (optimistic: tried once, then timed), not on the line through eager prompt chunks, whose
    base cost made a drafter that paid never draft at one request; such a step teaches the
    drafting bias nothing (its price was a guess)."""
    k = 16
    cost = CostModel()
    cost.compiled((), 4, (), (4, 8, 16))
    cost.drafter.pin([0.004, 0.001, 0.0])
    observe_one_request_chunks(cost)
    for _ in range(20):
        cost.observe_target(1, 1, 0.010)  # the compiled one-token step
    assert cost.one_key(3) == 4 and cost.one_key(5) == 8 and cost.one_key(17) == 17
    assert cost.untimed(3, 1) and not cost.untimed(1, 1) and not cost.untimed(17, 1)
    assert cost.target_s(3, 1) == cost.target_s(16, 1) == 0.010  # cold: its one-token step
    assert cost.target_s(17, 1) > 0.035  # wider than any graph: eager, the line
    policy, r = profiled_request(k)
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    assert policy.drafters([r], ctx) == [r]
    policy.widths([r], None, ctx)
    assert policy.untimed  # the engine learns no bias from this step
    for _ in range(20):
        cost.observe_target(3, 1, 0.013)  # the width-4 graph, timed: 2–4 tokens share it
    assert abs(cost.target_s(2, 1) - 0.013) < 1e-9 and not cost.untimed(4, 1)
    assert cost.snapshot()["target_1req_4tok_ms"] == pytest.approx(13.0)
    assert cost.untimed(5, 1)  # width 8: not timed yet
    eager = CostModel()  # no compiled widths (an eager engine): each count its own
    observe_one_request_chunks(eager)
    eager.observe_target(1, 1, 0.010)
    assert eager.one_key(3) == 3 and not eager.untimed(3, 1)
    assert eager.target_s(3, 1) > 0.03  # the line: an eager pass's base cost
    eager.drafter.pin([0.004, 0.001, 0.0])
    none, r = profiled_request(k, seed=1)
    assert none.drafters([r], PolicyContext(k, 1.0, eager, budget=512, other_tokens=0)) == []


def test_plain_batched_passes_get_their_own_costs_and_verification_keeps_the_line():
    """A compiled batched graph makes a plain step of n requests cheap while a step in which
    some verify runs eager: a plain step is priced from its table, not from the verify line."""
    cost = CostModel()
    for _ in range(40):
        for n in (4, 8):
            cost.observe_target(n, n, 0.030 + 0.001 * n)  # compiled plain steps
            cost.observe_target(3 * n, n, 0.050 + 0.008 * 3 * n)  # eager verification
    assert abs(cost.target_s(8, 8) - 0.038) < 1e-6
    assert abs(cost.target_s(24, 8) - (0.050 + 0.008 * 24)) < 3e-3
    assert abs(cost.target_s(6, 6) - 0.036) < 1e-6  # never measured: between its neighbours
    assert cost.snapshot()["target_plain_8req_ms"] == 38.0


def test_a_plain_count_is_priced_as_the_compiled_batch_it_pads_up_to():
    """15 requests run on the batch-16 graph: they cost what 16 do, not what the line through
    eager passes says; a new compiled graph makes the tables start over."""
    cost = CostModel()
    cost.compiled((4, 8, 16), 4)
    for _ in range(20):
        cost.observe_target(48, 16, 0.150)  # eager verification: the line
        cost.observe_target(16, 16, 0.040)  # the compiled batch-16 step
        cost.observe_target(8, 8, 0.020)  # the compiled batch-8 step
    assert cost.plain_key(15) == 16 and cost.plain_key(17) == 17
    assert abs(cost.target_s(15, 15) - 0.040) < 1e-6  # not 0.0375 (between 8 and 16)
    assert abs(cost.target_s(9, 9) - 0.040) < 1e-6
    assert cost.snapshot()["target_plain_16req_ms"] == 40.0
    cost.compiled((4, 8, 16), 4)  # nothing new: the tables stay
    assert 16 in cost.plain
    cost.compiled((4, 8, 16), 5)  # a graph more: what the tables timed may run another path
    assert not cost.plain and not cost.one_request and cost.plain_stale(16)


def test_a_compiled_batched_verification_is_priced_by_its_graph_and_tried_once_cold():
    """Requests that each verify at most a compiled width run on a batched verification graph
    at its own cost, whatever their tokens; wider ones run eager on the line. Unmeasured, such a
    pass is priced as its plain step (optimistic: tried once, then timed)."""
    cost = CostModel()
    cost.compiled((4, 8), 6, ((4, 4), (8, 4)))
    assert cost.verify_key(3, 4) == (4, 4) and cost.verify_key(5, 2) == (8, 4)
    assert cost.verify_key(3, 5) is None and cost.verify_key(9, 2) is None  # none that wide/big
    assert cost.verify_key(1, 4) is None and cost.verify_key(4, 1) is None  # one request; plain
    for _ in range(20):
        cost.observe_target(8, 8, 0.020)  # compiled plain batch-8
        cost.observe_target(40, 8, 0.120, widest=8)  # eager: wider than any graph
    assert abs(cost.target_s(12, 8, widest=3) - 0.020) < 1e-6  # cold: its plain step
    cost.observe_target(14, 8, 0.026, widest=3)  # the batch-8 width-4 graph, timed
    cost.observe_target(30, 8, 0.027, widest=4)
    assert cost.verify[(8, 4)] == 0.026 + 0.1 * (0.027 - 0.026)
    assert abs(cost.target_s(20, 7, widest=4) - cost.verify[(8, 4)]) < 1e-9  # 7 pad up to 8
    assert cost.target_s(20, 8, widest=5) > 0.05  # eager: the line through the 40-token passes
    assert cost.target_s(20, 8) > 0.05  # widest not known: the line
    cost.observe_target(20, 8, 0.300, prefill=True, widest=4)  # a prompt chunk: not the graph
    assert cost.verify[(8, 4)] < 0.03
    assert "target_verify_8req_4wide_ms" in cost.snapshot()
    cost.compiled((4, 8, 16), 7, ((4, 4), (8, 4)))  # a graph more: start over
    assert not cost.verify


def test_the_cost_policy_drafts_at_several_requests_where_the_batched_graph_makes_it_pay():
    """Eight requests whose drafts are accepted often: verifying ≤ 4 tokens each on the
    compiled batched graph pays where the eager line would not, so the policy keeps every
    request at most 4 wide."""
    cost, policy, reqs = drafting_eight(0.024)
    ctx = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0)
    chosen = policy.drafters(reqs, ctx)
    assert len(chosen) == 8
    widths = policy.widths(chosen, None, ctx)
    assert int(widths.max()) <= 4 and int(widths.min()) >= 2
    assert abs(policy.predicted_s - (policy.draft_s + 0.024)) < 1e-9


def test_a_drafted_token_is_worth_what_finishing_sooner_frees():
    """With a request queued, or alone, a token that finishes a request sooner is worth a full
    token; else what one request fewer saves of the plain step, per request's share: nothing
    where 7 requests pad up to the same compiled batch-8 step as 8, part of it on a line."""
    padded, _, _ = drafting_eight(0.024)
    ctx = PolicyContext(16, 1.0, padded, budget=512, other_tokens=0)
    assert freed_value(8, ctx) == 0.0
    queued = PolicyContext(16, 1.0, padded, budget=512, other_tokens=0, waiting=2)
    assert freed_value(8, queued) == 1.0
    assert freed_value(1, ctx) == 1.0
    line = CostModel()  # eager plain steps: 10 ms + 2 ms a request
    for n in (3, 4):
        for _ in range(20):
            line.observe_target(n, n, 0.010 + 0.002 * n)
    ctx = PolicyContext(16, 1.0, line, budget=512, other_tokens=0)
    assert freed_value(4, ctx) == pytest.approx(4 * 0.002 / 0.018)


def test_a_padded_batch_frees_nothing_before_its_step_is_timed():
    """Sixteen requests pad up to a compiled batch-16 plain step that was never timed: the line
    through eager passes would price 15 requests below 16, but both run the same padded step,
    so both are priced at the line's batch-16 point, and a drafted token that finishes a
    request sooner frees nothing."""
    cost = CostModel()
    cost.compiled((8, 16), 3, ((16, 4),))
    observe_eager_chunks(cost)
    line = cost.target.predict
    assert line([1.0, 15.0, 15.0]) < line([1.0, 16.0, 16.0])  # the line's two points
    assert cost.target_s(15, 15) == cost.target_s(16, 16) == line([1.0, 16.0, 16.0])
    assert cost.target_s(9, 9) == cost.target_s(16, 16) > cost.target_s(8, 8)
    ctx = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0)
    assert freed_value(16, ctx) == 0.0 == freed_value(13, ctx)
    assert cost.plain_key(9) != cost.plain_key(8)  # 9 and 8 pad to different batches: priced
    assert freed_value(9, ctx) > 0.0


def test_beside_a_prompt_chunk_a_drafted_token_is_priced_on_the_batch_end_step():
    """Eight requests on a compiled batch-8 step while a ninth reads its prompt: the pass with
    the chunk runs eager, where one request fewer saves a share of it, but the steps a request
    that finishes sooner would shorten are the batch's last plain ones, where 7 requests pad up
    to the same batch-8 step as 8: the drafts are worth nothing beside the chunk either, and
    the good requests do not draft."""
    cost, policy, reqs = drafting_eight(0.024)
    observe_eager_chunks(cost)
    chunk = PolicyContext(16, 1.0, cost, budget=512, other_tokens=64, other_widest=64)
    assert freed_value(8, chunk) == 0.0 == freed_value(8, replace(chunk, other_tokens=0))
    assert policy.drafters(reqs, chunk) == []


def test_without_a_queue_drafting_for_some_requests_of_a_padded_batch_does_not_pay():
    """Eight requests on a compiled batch-8 step, four of them hopeless. Drafting for the other
    four commits their tokens sooner, but with nobody queued for their slots the batch runs as
    long as the hopeless four, on the same padded step: the policy keeps to plain steps. With a
    request queued, the four draft; and with every request good, all eight draft (the batch
    then finishes sooner)."""
    cost, policy, reqs = drafting_eight(0.030)
    for r in reqs[4:]:
        for _ in range(40):
            policy.observe(r, 16, 0, 16)
    queued = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0, waiting=1)
    chosen = policy.drafters(reqs, queued)
    assert chosen and {id(r) for r in chosen} <= {id(r) for r in reqs[:4]}
    alone = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0)
    assert policy.drafters(reqs, alone) == [] and policy.freed == 0.0
    cost, policy, reqs = drafting_eight(0.030)
    assert len(policy.drafters(reqs, alone)) == 8


def test_a_batch_gains_what_its_last_request_gains():
    """``batch_gain``: tied requests gain the batch only what the one that did worst gained;
    a request ahead of the others gains it nothing; summed over steps it is exactly how much
    sooner the batch ends than with plain steps, whichever request is last."""
    assert batch_gain([10, 10, 10], [3, 1, 2]) == 0
    assert batch_gain([10, 10, 10], [3, 4, 2]) == 1
    assert batch_gain([10, 5], [3, 1]) == 2 and batch_gain([10, 5], [1, 5]) == 0
    assert batch_gain([2, 2], [4, 3]) == 1  # nothing past the end counts
    g = torch.Generator().manual_seed(2)
    left, steps, gained = [40] * 6, 0, 0
    while max(left) > 0:
        progress = [1 + int(torch.randint(0, 4, (1,), generator=g)) for _ in left]
        gained += batch_gain(left, progress)
        left = [max(n - p, 0) for n, p in zip(left, progress, strict=True)]
        steps += 1
    assert steps + gained == 40


def test_all_request_drafting_with_nobody_queued_is_worth_what_it_gained_the_batch():
    """Eight requests, all drafting, nobody queued: the plan counts its least request's
    expected drafts for the whole batch, and says so (``whole_least``). Once such steps have
    gained the batch a fifth of that lately (``whole_yield``), all eight keep to plain steps;
    with a request queued every drafted token counts and they draft; a new drafter starts over."""
    cost, policy, reqs = drafting_eight(0.030)
    alone = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0)
    chosen = policy.drafters(reqs, alone)
    assert len(chosen) == 8
    policy.widths(chosen, None, alone)
    least = policy.whole_least
    assert least is not None and 1.0 < least < 3.0
    queued = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0, waiting=1)
    policy.widths(policy.drafters(reqs, queued), None, queued)
    assert policy.whole_least is None  # the drafts count in full: not a whole-batch plan
    # a prompt chunk in the pass: its request ends the batch, so no plan is a whole-batch one
    chunk = PolicyContext(16, 1.0, cost, budget=512, other_tokens=40, other_widest=40)
    policy.widths(policy.drafters(reqs, chunk) or reqs, None, chunk)
    assert policy.whole_least is None
    for _ in range(60):
        cost.observe_whole_step(least, 0.2 * least)
    assert 0.2 < cost.whole_yield < 0.25 and cost.snapshot()["whole_yield"] < 0.25
    assert policy.drafters(reqs, alone) == [] and policy.whole_least is None
    assert len(policy.drafters(reqs, queued)) == 8
    cost.new_drafter()
    assert cost.whole_yield == 1.0 and len(policy.drafters(reqs, alone)) == 8


def test_the_known_work_ends_with_the_slot_that_ends_last():
    """``work_end``: queued requests go, in order, into the slot that frees first;
    ``queue_gain``: a drafting step gains only as far as it moves that end (against a plain
    step, which moves it one), and over a run it telescopes to the steps the run saved."""
    assert work_end([3, 5], [4], 2) == 7 and work_end([3], [4, 1], 2) == 4
    assert work_end([], [2, 2, 2], 2) == 4 and work_end([], [], 4) == 0
    assert queue_gain([10, 10], [3, 1], [], 2) == 0  # nobody queued: the slower slot ends last
    assert queue_gain([10, 20], [3, 1], [10], 2) == 0  # the queued one cannot outlast the 20
    assert queue_gain([10, 10], [3, 1], [10], 2) == 2  # … here it starts 2 steps sooner
    assert queue_gain([10, 2], [1, 0], [20], 2) == 0  # a slot not in the pass gains nothing
    assert queue_gain([4], [3], [6], 1) == 2  # one slot: every draft moves the end
    # a closed batch of 8 requests of 12 tokens at 3 slots, random drafts: Σ gain + steps = end
    g = torch.Generator().manual_seed(0)
    left, queued, steps, gained = [12, 12, 12], [12] * 5, 0, 0
    start = work_end(left, queued, 3)
    while left:
        progress = [1 + int(torch.randint(0, 3, (1,), generator=g)) for _ in left]
        gained += queue_gain(left, progress, queued, 3)
        left = [max(n - p, 0) for n, p in zip(left, progress, strict=True)]
        steps += 1
        while queued and 0 in left:  # a finished request's slot takes the next queued one
            left[left.index(0)] = queued.pop(0)
        left = [n for n in left if n] if not queued else left
    assert steps + gained == start


def test_drafts_with_a_queue_are_worth_what_they_gained_the_known_work():
    """With a request queued a drafted token counted in full; once drafting steps with a queue
    have moved the known work's end by little of what they planned (``queue_yield``), the eight
    keep to plain steps; plain steps with a queue let the yield back up (it is tried again); a
    new drafter starts over."""
    cost, policy, reqs = drafting_eight(0.030)
    queued = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0, waiting=1)
    assert len(policy.drafters(reqs, queued)) == 8 and cost.queue_yield == 1.0
    for _ in range(60):
        cost.observe_queue_step(10.0, 0.5)
    assert cost.queue_yield < 0.06 and cost.snapshot()["queue_yield"] < 0.06
    assert policy.drafters(reqs, queued) == []
    for _ in range(400):  # plain steps, as the engine takes them: decided, then measured
        policy.drafters(reqs, queued)
        cost.queue_idle_step()
    assert cost.queue_yield > 0.9 and len(policy.drafters(reqs, queued)) == 8
    for _ in range(60):
        cost.observe_queue_step(10.0, 0.5)
    cost.new_drafter()
    assert cost.queue_yield == 1.0


def observe_eager_chunks(cost: CostModel) -> None:
    """Eager passes of 2–9 requests beside a 64-token prompt chunk: 5 ms, 0.2 ms a token and
    4 ms a request."""
    for n in range(60, 100, 4):
        for m in range(2, 10):
            cost.observe_target(n, m, 0.005 + 0.0002 * n + 0.004 * m, prefill=True, widest=64)


def drafting_eight(verify_s: float) -> tuple[CostModel, CostPolicy, list[Request]]:
    """Eight requests whose slots are accepted 80% of the time, a compiled batch-8 plain step
    of 20 ms and a batch-8 width-4 verification of ``verify_s``."""
    k = 16
    cost = CostModel()
    cost.compiled((8,), 3, ((8, 4),))
    cost.drafter.pin([0.004, 0.0005, 0.0])
    for _ in range(40):
        cost.observe_target(8, 8, 0.020)
        cost.observe_target(80, 8, 0.200, widest=16)  # eager: 10 tokens each
        cost.observe_target(32, 8, verify_s, widest=4)  # compiled: 4 each
    policy = CostPolicy(k)
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=64)) for i in range(8)]
    g = torch.Generator().manual_seed(1)
    for r in reqs:
        for _ in range(40):
            policy.observe(r, k, int((torch.rand(k - 1, generator=g) < 0.8).cumprod(0).sum()), k)
    return cost, policy, reqs


def test_drafting_steps_that_took_longer_than_priced_make_drafting_dearer():
    """A narrow predicted gain: drafting pays by the parts' prices, but once drafting steps
    have taken 1.3× their price lately it does not, and the policy keeps to plain steps."""
    cost, policy, reqs = drafting_eight(0.040)
    ctx = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0)
    assert len(policy.drafters(reqs, ctx)) == 8
    for _ in range(30):
        cost.observe_drafting_step(0.050, 0.065)
    assert 1.25 < cost.drafting_bias < 1.3 and cost.snapshot()["drafting_bias"] > 1.25
    assert policy.drafters(reqs, ctx) == []
    cost.observe_drafting_step(0.050, 5.0)  # a stall: clipped to 2×
    assert cost.drafting_bias <= 0.9 * 1.3 + 0.1 * 2.0
    cost.observe_drafting_step(0.0, 1.0)  # nothing priced: nothing learned
    assert cost.drafting_bias <= 0.9 * 1.3 + 0.1 * 2.0


def test_steps_that_went_better_than_planned_never_make_a_drafter_pass_for_nothing_pay():
    """Drafting steps that took less than priced (a step beside a prompt chunk priced at 1.07 s
    took 0.46 s) once made every plan worth more than its tokens: a nearly free drafter pass
    that verified nothing looked better than the plain step, and 16 requests paid for drafter
    passes that verified nothing. The value is capped at 1, and a plan with no slot taken is
    not a plan."""
    k = 8
    cost = plain_cost()
    cost.drafter.pin([1e-4, 0.0, 0.0])  # a drafter pass nearly free
    for _ in range(30):
        cost.observe_drafting_step(1.07, 0.46)
    assert cost.drafting_bias < 0.6 and cost.drafting_value == 1.0
    policy = CostPolicy(k)
    reqs = [req(i) for i in range(16)]
    for r in reqs:  # drafts that never land
        for _ in range(30):
            policy.observe(r, k, 0, k)
    ctx = PolicyContext(k, 1.0, cost, budget=16 * k, other_tokens=0)
    assert policy.drafters(reqs, ctx) == []
    rate, widths = policy.plan(reqs, ctx, 0)
    assert rate == 0.0 and set(widths.values()) == {1}


def test_a_requests_unlucky_first_rounds_do_not_hold_it_plain_where_drafting_pays(monkeypatch):
    """Acceptance does not come in streaks (``bench/acceptance_memory.py``): a new request whose
    first two rounds missed, of a drafter whose slots the engine-wide profile has at 0.7, still
    drafts where drafting pays at that rate. With its profile over its last ~10 rounds shrunk
    with one round of the engine-wide one (the constants before 2026-12-07) those two misses
    priced its first slot at 0.24 and held it plain; fresh plans then never renewed it."""
    k = 8
    cost = CostModel()
    for n in range(1, 20):
        cost.observe_target(n, 1, 0.020 + 0.002 * n)
        cost.observe_drafter(1, 0.008)
    policy = CostPolicy(k, probe_every=10**6)  # no probes: the choice alone
    g = torch.Generator().manual_seed(0)
    other = req(0)
    for _ in range(300):
        policy.observe(other, k, int((torch.rand(k - 1, generator=g) < 0.7).cumprod(0).sum()), k)
    unlucky = req(1)
    policy.observe(unlucky, k, 0, k)
    policy.observe(unlucky, k, 0, k)
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    assert 0.5 < policy.survival(unlucky, k)[0] < 0.7
    assert policy.drafters([unlucky], ctx) == [unlucky]
    monkeypatch.setattr(policy_module, "DECAY", 0.9)
    monkeypatch.setattr(policy_module, "PRIOR_WEIGHT", 1.0)
    fresh = req(2)
    policy.observe(fresh, k, 0, k)
    policy.observe(fresh, k, 0, k)
    assert policy.survival(fresh, k)[0] < 0.3 and policy.drafters([fresh], ctx) == []


def test_a_drafting_value_that_stopped_the_drafting_fades_back_over_plain_steps():
    """The bias is measured on drafting steps alone: one that rose and stopped them would
    stand for good. Over plain steps it fades back to 1, so drafting is tried again, and steps
    that keep taking longer than priced stop it again."""
    cost, policy, reqs = drafting_eight(0.030)
    ctx = PolicyContext(16, 1.0, cost, budget=512, other_tokens=0)
    for _ in range(30):
        cost.observe_drafting_step(0.050, 0.090)  # slower than planned
    assert cost.drafting_value < 0.6 and policy.drafters(reqs, ctx) == []
    plain = 0
    while not policy.drafters(reqs, ctx):
        cost.plain_step()
        plain += 1
        assert plain < 100
    assert 5 < plain < 60 and cost.drafting_value > 0.7
    for _ in range(10):
        cost.observe_drafting_step(0.050, 0.090)
    assert policy.drafters(reqs, ctx) == []  # still short: stopped again
    for _ in range(500):
        cost.plain_step()
    assert cost.drafting_bias == pytest.approx(1.0, abs=1e-3)


def test_a_plain_price_is_stale_until_measured_and_again_after_a_while():
    cost = CostModel()
    cost.compiled((16,), 2)
    assert cost.plain_stale(16) and cost.plain_stale(1)
    cost.observe_target(1, 1, 0.012)
    assert not cost.plain_stale(1) and cost.plain_stale(16)
    cost.observe_target(16, 16, 0.040)
    assert not cost.plain_stale(16) and not cost.plain_stale(12)  # both run on batch 16
    for _ in range(PLAIN_REFRESH):
        cost.observe_target(48, 16, 0.150)
    assert not cost.plain_stale(16) and cost.plain_stale(1)  # 1 was timed one pass earlier
    cost.observe_target(48, 16, 0.150)
    assert cost.plain_stale(16)
    assert cost.plain_stale(20)  # no compiled batch runs 20: eager, and never timed either
    cost.observe_target(16, 16, 0.060)  # another process took a core: the late timing counts
    assert abs(cost.target_s(16, 16) - 0.050) < 1e-6  # for half (REFRESH_RATE) …
    cost.observe_target(16, 16, 0.060)
    assert abs(cost.target_s(16, 16) - 0.051) < 1e-6  # … a fresh one for a tenth
    eager = CostModel()  # nothing compiled: the line through verifying passes does not price
    for _ in range(20):  # a plain one either, so an eager plain step is timed all the same
        eager.observe_target(48, 16, 0.400)
    assert eager.plain_stale(16) and eager.plain_stale(1)
    eager.observe_target(16, 16, 0.190)
    assert not eager.plain_stale(16) and eager.target_s(16, 16) == 0.190


def test_a_drafter_that_always_pays_still_times_the_plain_step_it_beats():
    """With a perfect drafter the policy always drafts, so the plain price it compares against
    was never measured: it takes a plain step (no prefill beside it) when that price is stale,
    and drafts otherwise."""
    k = 8
    cost = CostModel()
    cost.compiled((4,), 2)  # the one-request step and batch 4 are compiled
    for n in range(2, 40):
        cost.observe_target(n, 1, 0.040 + 0.0005 * n)
        cost.observe_drafter(1, 0.004)
    policy = CostPolicy(k)
    r = req(0)
    for _ in range(20):
        policy.observe(r, k, k - 1, k)  # every draft accepted
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    assert cost.plain_stale(1)
    assert policy.drafters([r], ctx) == []  # times the plain step first
    assert policy.predicted_s == cost.target_s(1, 1)
    # the pass holds a request that cannot draft (on its last token) too: what it would time
    # is a batch-4 step, so that is the price checked
    cost.observe_target(4, 4, 0.030)
    ctx.requests = 2
    assert policy.drafters([r], ctx) == [r]
    ctx.requests = 0
    with_prefill = PolicyContext(k, 1.0, cost, budget=512, other_tokens=20)
    assert policy.drafters([r], with_prefill) == [r]  # that pass could not time it
    cost.observe_target(1, 1, 0.040)
    assert policy.drafters([r], ctx) == [r]
    steps = 0
    while policy.drafters([r], ctx):  # drafting steps until the price is stale again
        cost.observe_target(8, 1, 0.044)
        steps += 1
    assert steps == PLAIN_REFRESH + 1  # passes since the plain step: 0 … PLAIN_REFRESH


def test_passes_where_some_verify_are_priced_per_request_count_not_by_one_line():
    """Eager passes in which some requests verify cost more per request as requests grow (30,
    32, 78 ms at 4, 8, 16 requests): one line through them all is off at 16 requests, where the
    step decides whether drafting beats a compiled plain step; a line per request count is
    exact there, and it follows the machine when that count's costs change."""
    base = {16: 0.078, 8: 0.032, 4: 0.030}
    cost = CostModel()
    for _ in range(30):
        for reqs, a in base.items():
            cost.observe_target(reqs, reqs, a / 2)  # compiled plain step
            for extra in (4, 24):
                cost.observe_target(reqs + extra, reqs, a + 0.0005 * (reqs + extra))
        cost.observe_target(216, 16, 0.9, prefill=True)  # a prompt chunk: the shared line's
    expected = 0.078 + 0.0005 * 30
    line = cost.target.predict([1.0, 30.0, 16.0])
    assert abs(cost.target_s(30, 16) - expected) < 0.1 * abs(line - expected)
    assert abs(cost.target_s(16, 16) - 0.039) < 1e-6  # the plain step keeps its own table
    assert cost.snapshot()["target_mixed_16req_base_ms"] > 70
    for _ in range(60):  # another process takes half the cores: 16-request passes double
        for extra in (4, 24):
            cost.observe_target(16 + extra, 16, 2 * (0.078 + 0.0005 * (16 + extra)))
    assert abs(cost.target_s(30, 16) - 2 * expected) < 5e-3


def test_a_cold_request_count_never_drafts_below_its_measured_plain_step():
    """The first steps at 8 requests: the plain step (compiled) is measured, passes where some
    verify are not yet, and the shared line, fitted on 4-request passes, prices a pass of 9
    tokens below the plain one. Such a pass is priced at least the plain step, so requests
    whose drafts never survive take plain steps."""
    k = 8
    cost = CostModel()
    cost.compiled((4, 8), 3)
    for _ in range(30):  # eager 4-request verification: cheap per request, steep per token
        for extra in (1, 8, 16):
            cost.observe_target(4 + extra, 4, 0.012 + 0.0015 * (4 + extra))
        cost.observe_drafter(4, 0.002)
        cost.observe_drafter(8, 0.003)
    cost.observe_target(8, 8, 0.033)  # the compiled plain step at 8 requests
    assert cost.target.predict([1.0, 9.0, 8.0]) < 0.033  # the shared line tilts below it
    assert cost.target_s(9, 8) >= cost.target_s(8, 8) == 0.033
    policy = CostPolicy(k)
    reqs = [req(i) for i in range(8)]
    torch.manual_seed(0)
    for _ in range(20):
        for r in reqs:  # one draft in a hundred survives its first slot
            policy.observe(r, k, 1 if torch.rand(1) < 0.01 else 0, k)
    ctx = PolicyContext(k, 1.0, cost, budget=512, other_tokens=0)
    ctx.requests = 8
    assert policy.drafters(reqs, ctx) == []
    assert policy.predicted_s == 0.033 + policy.draft_s  # the plain step (and any probe)
