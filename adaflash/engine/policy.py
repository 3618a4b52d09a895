"""Verify-length policies: who drafts this step, and how many block slots the target verifies.

- ``ar``: nobody drafts (plain decoding).
- ``fixed``: everybody drafts, k̂ = k (DFlash).
- ``head``: everybody drafts, k̂ = clamp(⌊γ·â·k⌋, 1, k) from the length head (AdaFlash §3.2).
- ``cost``: maximise expected tokens per second with the online ``CostModel`` — a request may
  not draft at all (k̂ = 0: a plain decode step), and when nobody drafts the drafter does not
  run, so a step costs exactly a plain decode step. Speculation never loses by more than the
  estimates are off, plus the probes and plain timing steps that keep them current.

``cost`` in detail. Each request keeps decayed counts of how often each draft slot was accepted
when verified after every slot before it was (``reached``); its acceptance profile a_i is those
counts shrunk towards the engine-wide profile with ``PRIOR_WEIGHT`` rounds of it
(``shrunk_rate``). How much a request's own rounds say was measured
(``bench/acceptance_memory.py``, docs/results/policy/): a round that missed says next to nothing
about the next, while requests differ; so the profile follows ~20 rounds, shrunk with 8 rounds
of the engine-wide one (``DECAY``). The shrinkage is also what keeps the requests whose last
rounds went best from being overrated when they are chosen (the winner's curse).
The expected tokens from verifying w slots are τ(w) = 1 + Σ_{i<w} Π_{j≤i} a_j. With the
drafter's cost and the target's cost per verified token fixed, adding the next slot of a request
pays exactly when its survival Π a_j exceeds the current tokens-per-second times the time of one
more verified token; so slots are added greedily by survival, and the step's rate is evaluated
for every prefix. Who drafts is chosen the same way, comparing the best rate with each number of
drafting requests against the plain step; a number whose expected tokens, every slot counted,
over its cheapest possible step cannot beat the best so far is not planned at all (so a drafter
that does not pay costs the policy a few microseconds a step, not a plan per subset; and a
plain step that won — plans lost, or none could win — stands for ``REPLAN_EVERY`` steps while
nothing it was decided from changed, nobody's expectations looked at). A request
that has not drafted lately brings its drafter pass a backlog of context to catch up: a plan
charges it the share of the tokens the request has left that this step would commit
(``charged``), since once caught up it drafts on without it; the step's predicted price keeps
the whole backlog. A drafted token counts in full where it frees something: a request that
finishes a step sooner lets a queued one in, or it was the only one. With nobody queued, the
batch runs as long as its slowest request, so a plan's extra tokens are worth what the plain
step saves with one request fewer (nothing where both pad up to one compiled batch size;
``freed_value``), except as far as every request gains them (a plan in which all draft is worth
its least request's expected drafts, times the batch, times what such plans gained the batch
lately per drafts planned: ``CostModel.whole_yield``, ``batch_gain``). A request that has not
drafted for ``probe_every`` rounds is probed (its profile may be stale after a hot swap or on
a new domain); a probe that finds no draft more than its profile expected doubles that gap (up
to 256 rounds), one that does resets it. A probe is a *shadow* draft: the drafter proposes the
request's whole block, the target does not verify it, and the request takes its plain step as
if nothing had been drafted. The tokens it then commits are the
answer key: the drafts matched before the first miss are what verifying the block would have
accepted — exactly under greedy decoding, and in distribution under sampling, since a draft the
drafter proposes with certainty is accepted with the target's probability of that token, the
probability that the target's own sample is that token (``probe_outcome``). So a probe costs a
drafter pass and nothing else: the step stays the plain (compiled, batched) one, and the probe
measures every slot of the block, not a narrow verification's few; its slots join the profiles
as the committed tokens decide them (``observe_shadow``), not once the whole block is decided
(a block that was all right took 15 plain steps to answer, and nothing drafted meanwhile: 48
tokens of one request with the oracle drafter drafted twice). The engine keeps the same gap
for the drafter as a whole, and a new request starts from it, so a drafter that keeps failing is
not probed again by every request that arrives. When nobody drafts, the drafter-wide gap counts
steps, not a request's rounds (short replies would never reach it): after that many steps
without a drafter pass — and at the first step of a new drafter — a pass of probes runs, on up
to ``PROBE_REQUESTS`` ready requests with the least context to catch up (their drafter passes
are the cheapest); a pass whose probes find no more than the plans expected (the request's own
profile, or the engine-wide one where it has none: ``expected_accepted``) doubles the gap once,
and a probe that finds a draft more, at least, halves it (not back to ``probe_every`` at once,
and not for any accepted draft: a drafter known to land a token now and then would be probed as
often as a new one, and one known to be good where drafting does not pay, on and on). Nothing is
verified on faith: the engine-wide profile starts at a = 0, so a new drafter drafts once probes
have shown what it is worth. Probes
wait for a budget: every step adds ``PROBE_SHARE`` of a plain step's predicted time, times
``probe_every`` over the drafter-wide gap (the share backs off with the gap: 1/16 of it at 256
steps), up to ``PROBE_START_S``; each probe joins a drafter pass only while the budget is
positive, spending what it adds to that pass (``ride_along``; into debt, if it costs more); and
a probe's answer pays back the share of what it spent that its drafts found beyond that
expectation (÷ the slots compared: a drafter that turned good keeps being probed until the
profiles know it; one that finds what it was known to find pays in full). So probes of a
drafter that does not pay cost at most ``PROBE_SHARE`` of serving time, falling towards a
sixteenth of it, plus the start's ``PROBE_START_S`` (again after a new drafter version) and at
most one pass of debt. The other way round, a drafter that always pays would leave the plain
step it is compared against unmeasured: where the cost model says that price is stale
(``CostModel.plain_stale``), a step in which somebody would draft, with no prompt chunk in its
pass, is a plain step instead, and times it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from adaflash.cost_model import CostModel
from adaflash.engine.request import Request
from adaflash.engine.suffix import Proposal, SuffixProfile
from adaflash.models.length_head import verify_len


@dataclass
class PolicyContext:
    block_size: int
    gamma: float
    cost: CostModel
    budget: int  # verification tokens the pass may hold
    other_tokens: int  # prefill tokens in the same pass
    other_widest: int = 0  # the longest prompt chunk among them (a pass that widest runs eager)
    plain_requests: int = 0  # ready requests that do not draft this step (set by the round)
    requests: int = 0  # requests in this step's pass, ready to draft or not (set by the round)
    waiting: int = 0  # requests queued for a slot: one that finishes sooner lets one of them in
    # context positions a request would bring to the drafter pass (committed since it last
    # drafted: the longer it did not draft, the more its first draft costs); set by the round
    pending: Callable[[Request], int] = field(default=lambda r: 0)
    # this step's suffix drafts, by id(request) (``engine/suffix.py``; set by the engine)
    proposals: dict[int, Proposal] = field(default_factory=dict)


class Policy:
    """Base: everybody who can draft drafts, and verifies the whole block (``fixed``)."""

    name = "fixed"
    uses_head = False
    uses_suffix = False  # weighs suffix proposals (``suffix_widths``)
    predicted_s: float | None = None  # this step's time as planned, where a policy plans it
    untimed: bool = False  # … on a compiled pass never timed (``CostModel.untimed``)
    expected_tokens: float | None = None  # … and the tokens it expects the step to commit
    probes: Sequence[Request] = ()  # this step's shadow drafts (``drafters`` sets them)
    # a plan in which every request drafts with nobody queued: its least request's expected
    # drafts (what the plan counted for the whole batch); None for any other step
    whole_least: float | None = None
    # this step's suffix drafts taken: id(request) → k̂ (``drafters`` sets them; the ``cost``
    # policy alone weighs suffix proposals)
    suffix_widths: dict[int, int] = {}  # noqa: RUF012 (never mutated: replaced per step)

    def drafters(self, ready: list[Request], ctx: PolicyContext) -> list[Request]:
        return ready

    def observe_suffix(self, match: int, first: int, compared: int, accepted: int) -> None:
        """Slots of a suffix proposal decided by the committed tokens (``SuffixProfile``)."""

    def widths(
        self, spec: list[Request], a_hat: torch.Tensor | None, ctx: PolicyContext
    ) -> torch.Tensor:
        """k̂ per drafting request (anchor included), in [1, k]."""
        return torch.full((len(spec),), ctx.block_size)

    def reset(self) -> None:
        """A new drafter version: what was learned about the old one no longer holds."""

    def observe(self, r: Request, verify_len: int, accepted: int, block_size: int) -> None:
        """A verified round's outcome (every policy keeps the per-request profile current)."""
        if verify_len < 2:
            return
        count_slots(*profile(r, block_size), reached(verify_len, accepted), accepted, DECAY)
        r.last_drafted = r.rounds

    def observe_probe(
        self, r: Request, compared: int, accepted: int, block_size: int, seen: int = 0
    ) -> None:
        """A shadow draft's outcome (``probe_outcome``): ``compared`` draft slots checked
        against the committed tokens, the first ``accepted`` of them right. It says what
        verifying ``compared`` + 1 tokens would have said: a round of that width. ``seen``: its
        first slots already observed while it was undecided (``observe_shadow``)."""
        self.observe_shadow(r, seen, compared, accepted, block_size)
        r.last_drafted = r.rounds

    def observe_shadow(
        self, r: Request, first: int, compared: int, accepted: int, block_size: int
    ) -> None:
        """Slots ``first`` … of a shadow draft that ``compared`` / ``accepted`` (counted from
        its first slot) decide: those matched so far were right, each after every slot before
        it (``reached``, as a round of width ``compared`` + 1)."""
        slots = reached(compared + 1, accepted)[first:]
        count_slots(*profile(r, block_size), slots, accepted, DECAY)


class ArPolicy(Policy):
    name = "ar"

    def drafters(self, ready: list[Request], ctx: PolicyContext) -> list[Request]:
        return []


class HeadPolicy(Policy):
    name = "head"
    uses_head = True

    def widths(
        self, spec: list[Request], a_hat: torch.Tensor | None, ctx: PolicyContext
    ) -> torch.Tensor:
        assert a_hat is not None
        return verify_len(a_hat, ctx.block_size, ctx.gamma)


# per verified round: a request's profile follows its last ~20 rounds … (one request at a time,
# every round verifying the whole block, shipped drafter, 8 eval prompts × 256 tokens a domain,
# bench/acceptance_memory.py: after a round that accepted no draft the next accepted one or
# more 34% of the time on math, 46% on code, 35% on chat; after one that accepted some, 28%,
# 43%, 42% — no streaks to follow — while requests' own means ranged 0.17–0.54 drafts a round
# on math; the Brier score of slots 1–3 predicted before each round, 0.2048 / 0.2389 / 0.2258
# on math / code / chat with these constants, was within 0.0012 of the grid's best on each; the
# ones before, 10 rounds shrunk with one, scored 0.2122 / 0.2444 / 0.2322 — on math worse than
# the engine-wide profile alone, 0.2070 in a scratch run of the same rounds)
DECAY = 0.95
ENGINE_DECAY = 0.995  # … and the engine-wide profile its last ~200
MAX_PROBE_GAP = 256  # rounds: a request whose probes keep failing is probed this rarely
PRIOR_WEIGHT = 8.0  # … shrunk with this many rounds' worth of the engine-wide profile
START = (0.0, 1.0)  # engine-wide (accepted, verified) per slot before any round: a = 0, weak
# probes spend at most this share of the serving time, at the drafter-wide gap ``probe_every``
# (less as it grows) … (with a drafter that never pays, the share is what cost speculation
# loses to plain decoding: 1% was ~1% of every cell at C = 1)
PROBE_SHARE = 0.005
# … after a start of this many seconds (also the budget's cap): a probe pass of a request or
# two; what its drafts find is paid back, so a drafter that pays is probed on (0.25 s was up
# to 5.6% of a cold 20-second study cell; 0.06 s, three lone passes at C = 8, ~0.6%)
PROBE_START_S = 0.02
PROBE_REQUESTS = 4  # a pass of probes alone takes up to this many requests, cheapest first
# steps a plain step that won stands while nothing it was decided from changed (the profiles,
# how many requests are ready, prompt chunks and queue): a drafter that looks good where drafting
# does not pay had every subset planned every step (the oracle drafter at C = 16 on chat, Zen 5:
# ~0.5 ms of a 14 ms step, 0.95× ``ar``); one that does not pay had every request's expectations
# sorted and bounded (shipped drafter, chat at C = 8 in the study's process, Zen 3: the round's
# draft part 100 → 30 µs a plain step, median)
REPLAN_EVERY = 8
CATCH_UP_HORIZON = 128  # tokens at most over which a plan spreads a request's context backlog
_states = itertools.count(1)  # numbers the cost policies' profile states, process-wide


def reached(verify_len: int, accepted: int) -> range:
    """The slots (0-based: slot i is draft i + 1) whose acceptance a verified round measured,
    given that every slot before was accepted: verified, and at most one past the accepted
    ones. So ok[i] / seen[i] estimates a_i = P(slot i accepted | slots < i accepted), the
    factor that ``CostPolicy.survival`` multiplies. (Counting every verified slot instead
    estimated the survival Π_{j≤i} a_j itself, and multiplying those squared it away: slots
    each accepted 70% of the time after the last were planned with survival 0.7, 0.34, 0.12
    instead of 0.7, 0.49, 0.34.)"""
    return range(min(verify_len - 1, accepted + 1))


def count_slots(
    seen: list[float], ok: list[float], slots: range, accepted: int, decay: float
) -> None:
    """One more measurement of each of ``slots`` in a profile (``seen``/``ok`` per slot,
    decayed by ``decay``): right where it is among the first ``accepted``."""
    for i in slots:
        seen[i] = decay * seen[i] + 1.0
        ok[i] = decay * ok[i] + float(i < accepted)


def shrunk_rate(ok: float, seen: float, prior: float, weight: float | None = None) -> float:
    """A slot's acceptance by a request's own decayed counts, shrunk towards ``prior`` (the
    engine-wide rate) with ``weight`` rounds' worth of it (``PRIOR_WEIGHT``), in [0, 1]."""
    w = PRIOR_WEIGHT if weight is None else weight
    return min(max((ok + w * prior) / (seen + w), 0.0), 1.0)


def profile(r: Request, block_size: int) -> tuple[list[float], list[float]]:
    if len(r.slot_seen) != block_size - 1:
        r.slot_seen, r.slot_ok = [0.0] * (block_size - 1), [0.0] * (block_size - 1)
    return r.slot_seen, r.slot_ok


class CostPolicy(Policy):
    name = "cost"
    uses_suffix = True

    def __init__(self, block_size: int, probe_every: int = 16) -> None:
        self.block_size, self.probe_every = block_size, probe_every
        self.probes: list[Request] = []
        self.predicted_s: float | None = None  # this step's time as planned (engine checks it)
        self.expected_tokens: float | None = None  # … and its tokens (verified requests')
        self.draft_s = 0.0  # this step's drafter pass as planned
        self.freed = 1.0  # this step's ``freed_value``
        self.whole_least: float | None = None
        # what the last plain step that won was decided from, and the steps it still stands
        self.standing: tuple[tuple[int, int, int, int], int] | None = None
        # what suffix drafts are worth (kept across drafter versions: they are not the drafter's)
        self.suffix = SuffixProfile()
        self.suffix_expected = 0.0  # this step's suffix drafters' expected tokens
        self.reset()

    def reset(self) -> None:
        self.state = next(_states)  # what ``survival`` was computed from: new on every change
        # engine-wide profile: decayed counts over all requests; it starts at a = 0 per slot
        # with little weight: nothing is verified on faith, a probe finds out first (it costs
        # a drafter pass; betting a prior of 0.5 on 16 requests' first drafts cost a run at
        # C = 16 with the weak drafter a quarter of its time, before shadow drafts)
        self.seen = [START[1]] * (self.block_size - 1)
        self.ok = [START[0]] * (self.block_size - 1)
        self.probe_gap = self.probe_every  # the drafter's: where a new request's gap starts
        self.idle_steps = self.probe_gap  # steps since the drafter last ran: probe at once
        self.probe_passes = self.backed_off = 0  # passes with probes; the last that backed off
        # id(request) → the pass its probe went in, its gap then, and what it spent
        # … and the drafts it was expected to find within each number of slots compared
        self.launched: dict[int, tuple[int, int, float, list[float]]] = {}
        self.probe_budget_s = PROBE_START_S  # what probes may still spend (docstring)

    def observe_probe(
        self, r: Request, compared: int, accepted: int, block_size: int, seen: int = 0
    ) -> None:
        # what it found beyond what was known of its request when launched (a draft more, at
        # least: ``expected_accepted``) pays back that share of it and halves the drafter-wide
        # gap: a drafter that turned good is probed on until the profiles know it; probes that
        # find no more back off
        # (once per probe pass: a pass of four that found nothing doubles the gap once), and
        # so does the request's own gap while its probes find nothing
        launched, gap, spent, expected = self.launched.pop(id(r), (0, self.gap(r), 0.0, []))
        if not expected:  # (not launched by ``drafters``: judged against the profile as it is)
            expected = self.expected_accepted(r, block_size)
        surprise = accepted - expected[compared - 1]
        if surprise >= 1.0:  # a draft more, at least
            refund = spent * min(surprise / compared, 1.0)
            self.probe_budget_s = min(self.probe_budget_s + refund, PROBE_START_S)
            self.probe_gap = max(self.probe_gap // 2, self.probe_every)
            r.probe_gap = self.probe_every
        else:
            if launched > self.backed_off:
                self.probe_gap = min(2 * self.probe_gap, MAX_PROBE_GAP)
                self.backed_off = launched
            r.probe_gap = min(2 * gap, MAX_PROBE_GAP)
        super().observe_probe(r, compared, accepted, block_size, seen)

    def observe_shadow(
        self, r: Request, first: int, compared: int, accepted: int, block_size: int
    ) -> None:
        self.state = next(_states)  # profiles change
        super().observe_shadow(r, first, compared, accepted, block_size)
        if len(self.seen) != block_size - 1:
            return
        slots = reached(compared + 1, accepted)[first:]
        count_slots(self.seen, self.ok, slots, accepted, ENGINE_DECAY)

    def expected_accepted(self, r: Request, block_size: int) -> list[float]:
        """Drafts a probe of ``r`` finds within its first 1, 2, … slots compared by what is
        known already (kept when it is launched, as its slots join the profiles before it is
        decided): ``r``'s own rate for each slot it has been measured at, the engine-wide one
        for a slot it has not. (Judged against the engine-wide profile alone, the oracle
        drafter's all-hit probes on a Zen 2 EPYC, where drafting did not pay at 8 requests,
        stayed "surprising" for ~30 probes — that profile creeps up as n/(n+1) from a = 0 —
        each refunded and halving the gap: 4.1% of the run went to probes that could not change
        a plan, 0.97× ``ar``.)"""
        seen, ok = profile(r, block_size)
        out, total, s = [], 0.0, 1.0
        for i in range(block_size - 1):
            s *= ok[i] / seen[i] if seen[i] > 0 else self.engine_rate(i)
            total += s
            out.append(total)
        return out

    def engine_rate(self, i: int) -> float:
        """Slot i's acceptance by the engine-wide profile (after every slot before it)."""
        return self.ok[i] / max(self.seen[i], 1e-9)

    def gap(self, r: Request) -> int:
        """Rounds between ``r``'s probes: its own, or the drafter's until it has one."""
        return r.probe_gap or self.probe_gap

    def observe(self, r: Request, verify_len: int, accepted: int, block_size: int) -> None:
        if verify_len < 2 and len(self.seen) == block_size - 1:
            return  # a plain round measures nothing (most rounds)
        self.state = next(_states)  # profiles change below
        super().observe(r, verify_len, accepted, block_size)
        if len(self.seen) != block_size - 1:
            self.block_size = block_size
            self.reset()
        count_slots(self.seen, self.ok, reached(verify_len, accepted), accepted, ENGINE_DECAY)

    def survival(self, r: Request, block_size: int) -> list[float]:
        """Π_{j≤i} a_j for slots i = 1 … k−1 of this request. Kept on the request until a
        verified round or a probe changes a profile (recomputed for 16 requests every step, it
        took 0.23 ms a step); the list returned is that kept one: read it, never change it."""
        return self.kept_survival(r, block_size)[1]

    def expected_drafts(self, r: Request, block_size: int) -> float:
        """Σ of ``r``'s survival: the drafts it would be expected to land with every slot
        verified (kept with it)."""
        return self.kept_survival(r, block_size)[2]

    def kept_survival(self, r: Request, block_size: int) -> tuple[int, list[float], float]:
        kept = r.survival
        if kept is None or kept[0] != self.state or len(kept[1]) != block_size - 1:
            seen, ok = profile(r, block_size)
            out, s = [], 1.0
            for i in range(block_size - 1):
                s *= shrunk_rate(ok[i], seen[i], self.engine_rate(i))
                out.append(s)
            kept = r.survival = (self.state, out, sum(out))
        return kept

    def plan(
        self,
        reqs: list[Request],
        ctx: PolicyContext,
        plain: int,
        survival: dict[int, list[float]] | None = None,
        ranked: list[tuple[float, int, int]] | None = None,
        target_s: dict[tuple[int, tuple[int, int] | None], float] | None = None,
        charge: dict[int, float] | None = None,
        free: bool = False,
    ) -> tuple[float, dict[int, int]]:
        """Best expected rate (tokens/s) and widths when ``reqs`` draft (``plain`` others
        take a plain step): greedy slots by survival (0 and widths of 1: no slot worth one).
        ``ranked`` (every candidate slot of a superset of ``reqs``, by survival), ``target_s``
        (pass seconds by token count and the compiled graph that runs it, this step's request
        count) and ``charge`` (each request's ``charged`` context) let ``drafters`` plan many
        subsets for the price of one sort. ``free``: drafts that need no drafter pass (suffix
        proposals, ``survival`` theirs)."""
        k = ctx.block_size
        surv = survival or {id(r): self.survival(r, k) for r in reqs}
        if charge is None and not free:
            charge = {id(r): charged(r, ctx, sum(surv[id(r)])) for r in reqs}
        if ranked is None:
            ranked = rank_slots(reqs, surv)
        memo = {} if target_s is None else target_s
        widths = {id(r): 1 for r in reqs}
        batch = float(len(reqs) + plain)  # every request yields at least its bonus token
        tokens = batch  # … plus its expected drafts
        # what the drafts are worth (``freed_value``): where a request that finishes sooner
        # frees nothing, a step's extra tokens count in full only as far as every request gains
        # them (the batch runs as long as its slowest); ``extra``: each request's expected drafts
        freed, whole = self.freed, not plain and self.freed < 1.0 and alone(ctx)
        extra = dict.fromkeys(widths, 0.0) if whole else {}
        worth, least = batch, 0.0  # least: the least of ``extra``
        # … of which the batch as a whole gained that share lately (``whole_yield``)
        whole_yield = ctx.cost.whole_yield if whole else 1.0
        n_tok = len(reqs) + plain + ctx.other_tokens
        n_req = len(reqs) + plain
        widest = max(1, ctx.other_widest)  # the widest request's tokens so far
        graph = ctx.cost.verify_key(n_req, widest)  # the compiled pass that runs it (None: eager)

        def pass_s(n: int) -> float:
            key = (n, graph)  # its price depends on the tokens and the graph alone
            if key not in memo:
                memo[key] = ctx.cost.target_s(n, n_req, widest)
            return memo[key]

        fixed = (
            0.0
            if charge is None
            else ctx.cost.drafter_s(len(reqs), sum(charge[id(r)] for r in reqs))
        )
        # what drafting steps committed and took against their plans, lately
        value = ctx.cost.drafting_value
        best_rate, best_taken = value * worth / (fixed + pass_s(n_tok)), 0
        taken: list[tuple[int, int]] = []  # slots in the order they were added
        limit = ctx.budget + ctx.other_tokens
        for s, rid, w in ranked:  # each request's slots come in order: survival decreases
            if widths.get(rid) != w - 1:  # not in this subset, or an earlier slot was not taken
                continue
            if n_tok + 1 > limit:
                break
            widths[rid] = w
            if w > widest:  # the pass may leave its compiled graph for a wider one, or eager
                widest, graph = w, ctx.cost.verify_key(n_req, w)
            taken.append((rid, w))
            tokens += s
            n_tok += 1
            if whole:
                held, extra[rid] = extra[rid], extra[rid] + s
                if held <= least:  # it held the least: the least may have risen
                    least = min(extra.values())
            worth = drafts_worth(batch, tokens, freed, least * whole_yield)
            rate = value * worth / (fixed + pass_s(n_tok))
            if rate > best_rate:
                best_rate, best_taken = rate, len(taken)
        best = {id(r): 1 for r in reqs}  # the widths at the best prefix of added slots
        for rid, w in taken[:best_taken]:
            best[rid] = w
        # no slot taken is no plan: a drafter pass that verifies nothing is a plain step with
        # a drafter pass beside it
        return (best_rate if best_taken else 0.0), best

    def drafters(self, ready: list[Request], ctx: PolicyContext) -> list[Request]:
        self.predicted_s = self.expected_tokens = None  # prefills only: nothing planned
        self.whole_least, self.untimed = None, False
        self.probes = []
        self.suffix_widths, self.suffix_expected = {}, 0.0
        ready = self.suffix_stage(ready, ctx)
        if not ready and self.suffix_widths:  # every ready request drafts from its suffix
            n_req, n_tok, widest = len(self.suffix_widths), ctx.other_tokens, ctx.other_widest
            self.predicted_s = ctx.cost.target_s(n_tok, n_req, widest)
            self.untimed = ctx.cost.untimed(n_tok, n_req, widest)
            self.expected_tokens = self.suffix_expected
            return []
        if not ready:
            return []
        plain_s = ctx.cost.target_s(len(ready) + ctx.other_tokens, len(ready))
        self.predicted_s = plain_s  # unless somebody drafts (``widths``)
        made_of = (self.state, len(ready), ctx.other_tokens, ctx.waiting)
        if self.standing is not None and self.standing[0] == made_of:
            # nothing changed since the plain step won: it still stands
            left = self.standing[1]
            self.standing = (made_of, left - 1) if left > 1 else None
            order, best_n = ready, 0
        else:
            order, best_n = self.choose(ready, ctx, plain_s)
            self.standing = None if best_n else (made_of, REPLAN_EVERY - 1)
        if best_n and not ctx.other_tokens and ctx.cost.plain_stale(ctx.requests or len(ready)):
            # drafting would pay by the estimates, but the compiled plain step it beats was
            # never timed at this batch size or not lately: this step is that plain step (a
            # drafter that always pays loses one step's speculation per compiled batch size
            # it meets, and one in PLAIN_REFRESH after that)
            self.draft_s = 0.0
            return []
        chosen = order[:best_n]
        probes = self.probes = self.launch_probes(chosen, order[best_n:], ctx, plain_s)
        # the drafter's pass, priced now: once it ran, nothing is pending
        passed = chosen + probes
        self.draft_s = ctx.cost.drafter_s(len(passed), sum(ctx.pending(r) for r in passed))
        if probes and not chosen:  # a plain step with a drafter pass beside it
            self.predicted_s = plain_s + self.draft_s
            self.expected_tokens = float(ctx.requests or len(ready))  # one token each
        return chosen

    def suffix_stage(self, ready: list[Request], ctx: PolicyContext) -> list[Request]:
        """Which ready requests draft from their suffix proposal this step (``suffix_widths``),
        and how wide: the plan that maximises expected tokens/s with their proposals' survival
        (``SuffixProfile``, by match length) and no drafter pass to pay. Their verification
        tokens join the pass the drafter's plans are priced in (``ctx.other_tokens``); the
        others are returned, for the drafter."""
        cands = [r for r in ready if id(r) in ctx.proposals]
        if not cands:
            return ready
        surv = {}
        for r in cands:
            p = ctx.proposals[id(r)]
            surv[id(r)] = self.suffix.survival(p.match, len(p.tokens))
        self.freed = freed_value(len(ready), ctx)
        rate, widths = self.plan(cands, ctx, len(ready) - len(cands), surv, free=True)
        taken = {rid: w for rid, w in widths.items() if w > 1} if rate > 0 else {}
        if not taken:
            return ready
        self.suffix_widths = taken
        self.suffix_expected = sum(1 + sum(surv[rid][: w - 1]) for rid, w in taken.items())
        ctx.other_tokens += sum(taken.values())
        ctx.other_widest = max(ctx.other_widest, *taken.values())
        return [r for r in ready if id(r) not in taken]

    def observe_suffix(self, match: int, first: int, compared: int, accepted: int) -> None:
        self.suffix.observe(match, first, compared, accepted)

    def choose(
        self, ready: list[Request], ctx: PolicyContext, plain_s: float
    ) -> tuple[list[Request], int]:
        """``ready`` by their expected drafts, and how many of the first draft this step (0:
        nobody, the plain step of ``plain_s`` seconds wins): the best plan of each number that
        its bound does not rule out."""
        k = ctx.block_size
        # candidates by their value: expected extra tokens from the first few slots
        gain = {id(r): self.expected_drafts(r, k) for r in ready}
        order = sorted(ready, key=lambda r: -gain[id(r)])
        ranked: list[tuple[float, int, int]] | None = None  # every slot by survival, once
        seconds: dict[tuple[int, tuple[int, int] | None], float] = {}
        plain_rate = len(ready) / plain_s
        self.freed = freed_value(len(ready), ctx)
        # what bounds every plan below: a drafting step's target pass costs at least the plain
        # one (or the narrowest wider pass, where a fitted line tilts below it)
        narrowest = ctx.cost.target_s(
            len(ready) + ctx.other_tokens + 1, len(ready), max(2, ctx.other_widest)
        )
        least_pass = min(plain_s, narrowest)
        best_n, best_rate = 0, plain_rate

        def most_worth(tokens: float, every: bool) -> float:
            """At most what a plan with ``tokens`` expected is worth (``drafts_worth``: where
            ``every`` request drafts, nobody queued, as if the least gained the average)."""
            least = (tokens - len(ready)) / len(ready) * ctx.cost.whole_yield if every else 0.0
            return drafts_worth(len(ready), tokens, self.freed, least)

        # the bound below for every subset at once: all requests' expected tokens over the
        # cheapest drafting step there is (one request's drafter pass, nothing to catch up; the
        # fit's parts are ≥ 0) — where even that loses, no subset is looked at (a drafter that
        # does not pay, most steps: weak drafter, blend at C = 16, Zen 5, this call took 284 µs
        # a step under bench/profile_study.py's cProfile before, 145 after; with each request's
        # Σ survival kept beside it and the lists looked up only for a plan, 17.5 → 11.8 µs a
        # call in a loop, 16 requests of a useless drafter)
        everything = most_worth(len(ready) + sum(gain.values()), alone(ctx))
        best_any = ctx.cost.drafting_value * everything / (ctx.cost.drafter_s(1) + least_pass)
        if best_any <= best_rate:
            return order, 0
        surv = {id(r): self.survival(r, k) for r in order}
        charge = {id(r): charged(r, ctx, gain[id(r)]) for r in order}  # context, per step
        tokens, pending = float(len(ready)), 0.0
        for n, r in enumerate(order, 1):
            tokens, pending = tokens + gain[id(r)], pending + charge[id(r)]
            # no plan of these n can beat the best when all their expected tokens (what they
            # are worth, where others take a plain step: ``freed_value``) over the cheapest step
            # they could take do not (a drafter that does not pay: no plan at all, which was
            # most of this policy's time per step)
            # (with all drafting, at most all of it: as if the least gained the average)
            worth = most_worth(tokens, n == len(ready) and alone(ctx))
            step_s = ctx.cost.drafter_s(n, pending) + least_pass
            if ctx.cost.drafting_value * worth / step_s <= best_rate:
                continue
            if ranked is None:
                ranked = rank_slots(ready, surv)
            rate, _ = self.plan(order[:n], ctx, len(ready) - n, surv, ranked, seconds, charge)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return order, best_n

    def launch_probes(
        self, chosen: list[Request], rest: list[Request], ctx: PolicyContext, plain_s: float
    ) -> list[Request]:
        """This step's probes (shadow drafts) among ``rest``, the ready requests that do not
        draft, paid from the budget (docstring): when the drafter runs for ``chosen``, those
        that have not drafted for their gap join its pass, cheapest first, while the budget
        lasts; when it would not run, a pass of up to PROBE_REQUESTS of them once the drafter
        has been idle for the drafter-wide gap. ``plain_s``: this step's plain price."""
        share = PROBE_SHARE * self.probe_every / self.probe_gap  # backs off with the gap
        self.probe_budget_s = min(self.probe_budget_s + share * plain_s, PROBE_START_S)
        # (a request whose probe awaits its answer is not probed again)
        if chosen:
            due = [r for r in rest if r.shadow is None and r.rounds - r.last_drafted >= self.gap(r)]
            due.sort(key=ctx.pending)
            riders = self.ride_along(chosen, due, ctx)
        else:
            self.idle_steps += 1
            lone = self.idle_steps >= self.probe_gap and self.probe_budget_s > 0
            idle = [r for r in rest if r.shadow is None] if lone else []
            riders = self.ride_along([], sorted(idle, key=ctx.pending)[:PROBE_REQUESTS], ctx)
        probes = [r for r, _ in riders]
        if chosen or probes:
            self.idle_steps = 0
        if probes:
            self.probe_passes += 1
        for r, spent in riders:  # its gap counts from now
            r.last_drafted = r.rounds
            expected = self.expected_accepted(r, ctx.block_size)
            self.launched[id(r)] = (self.probe_passes, self.gap(r), spent, expected)
        return probes

    def ride_along(
        self, chosen: list[Request], due: list[Request], ctx: PolicyContext
    ) -> list[tuple[Request, float]]:
        """The probes of ``due`` (with what each spent) that join the drafter pass of a step in
        which ``chosen`` draft (none: a pass of probes alone), in order, each while the budget is
        positive and spending what it adds to that pass: one more request, and its context to catch
        up — even beyond what is left (one pass may cost more than the cap): the debt holds the next
        probes back until plain steps have paid it off. (Joining for free, all 15 other requests of
        a step of 16 were probed together every 16 rounds.)"""
        if not due or self.probe_budget_s <= 0:
            return []
        pending = sum(ctx.pending(r) for r in chosen)
        pass_s = ctx.cost.drafter_s(len(chosen), pending)
        out: list[tuple[Request, float]] = []
        for r in due:
            if self.probe_budget_s <= 0:
                break
            pending += ctx.pending(r)
            more_s = ctx.cost.drafter_s(len(chosen) + len(out) + 1, pending)
            spent = max(more_s - pass_s, 0.0)
            self.probe_budget_s -= spent
            pass_s = more_s
            out.append((r, spent))
        return out

    def widths(
        self, spec: list[Request], a_hat: torch.Tensor | None, ctx: PolicyContext
    ) -> torch.Tensor:
        k = ctx.block_size
        surv = {id(r): self.survival(r, k) for r in spec}
        _, widths = self.plan(spec, ctx, ctx.plain_requests, surv)
        chosen = [widths[id(r)] for r in spec]
        drafts = [sum(surv[id(r)][: w - 1]) for r, w in zip(spec, chosen, strict=True)]
        whole = not ctx.plain_requests and alone(ctx) and self.freed < 1.0 and max(chosen) > 1
        self.whole_least = min(drafts) if whole else None  # what ``plan`` counted for all
        n_req = len(spec) + ctx.plain_requests
        n_tok = sum(chosen) + ctx.plain_requests + ctx.other_tokens
        widest = max([*chosen, max(1, ctx.other_widest)])
        self.predicted_s = self.draft_s + ctx.cost.target_s(n_tok, n_req, widest)
        self.untimed = ctx.cost.untimed(n_tok, n_req, widest)
        self.expected_tokens = ctx.plain_requests + len(spec) + sum(drafts) + self.suffix_expected
        return torch.tensor(chosen)


def charged(r: Request, ctx: PolicyContext, drafts: float) -> float:
    """The context positions a plan charges ``r``'s drafter pass: what a request that drafts on
    brings each step (the tokens a drafting step commits: 1 + ``drafts``, its expected drafts,
    Σ survival) in full, and the backlog beyond it — positions committed while it did not
    draft, one-time work that lets it draft from now on — spread over the tokens it has left
    (up to ``CATCH_UP_HORIZON``; a reply may end sooner), this step's share of them. The
    step's price as predicted (``draft_s``, what ``drafting_bias`` learns from) keeps the whole
    backlog. (Charged in full to the first drafting step, the oracle drafter at 8 requests was
    priced 26–61 ms a drafter pass instead of 16–29 against a plain step of 17–18 ms, and every
    plain step added to the backlog, AMX, study at d631cf5. Charged so, on a Zen 5 EPYC it
    still does not draft at 8 requests, rightly: its drafter pass alone, 10–12 ms, costs more
    than the plain step, 9.5 ms, and drafting forced there ran 0.82× plain decoding.)"""
    pending, expected = float(ctx.pending(r)), 1.0 + drafts
    steady = min(pending, expected)
    horizon = max(min(r.tokens_left, CATCH_UP_HORIZON), 1)
    return steady + (pending - steady) * min(expected / horizon, 1.0)


def alone(ctx: PolicyContext) -> bool:
    """Whether this step's requests are the whole known work: nobody queued, and no prompt
    chunk in the pass (a request still reading its prompt has all its tokens ahead of it, so
    the batch ends with it, however the others draft)."""
    return not ctx.waiting and not ctx.other_tokens


def freed_value(requests: int, ctx: PolicyContext) -> float:
    """What a drafted token is worth against a token of the batch's plain step. A token that
    lets a request finish a step sooner frees its slot: where a queued request takes that slot
    (``ctx.waiting``), what such tokens gained the end of the known work lately
    (``CostModel.queue_yield``, ``queue_gain``) — but a full token where it is the only
    request, queue or not; else only what the plain step saves with one request fewer, per
    request's share of it — nothing where both pad up to the same compiled batch size.
    (Without it, drafting for some of 16 requests that all run to the same length committed
    their tokens sooner and saved no step: shipped drafter, code at C = 16 on a Zen 2 EPYC,
    0.90× ``ar`` with 264 steps against its 264.) That saving comes at the end of the batch,
    in its last plain steps, so it is priced on a plain step of these requests alone, not on
    this step's pass: a prompt chunk beside them makes this pass eager, where one request
    fewer always saves something, while the steps it would shorten run compiled. (Priced on
    this pass, requests that had read their prompts could draft beside the others' chunks;
    in the bd6f3bf study the oracle drafter's ``cost`` at C = 16, nobody queued, took as many
    steps as ``ar``, 396, and ran 0.95×.)"""
    if requests <= 1:  # (one slot: every drafted token is a step sooner for all that wait;
        return 1.0  # its drafts count as the profiles expect them)
    if ctx.waiting:  # … as far as such tokens brought the queued work's end closer lately
        return ctx.cost.queue_yield
    # (where both pad up to one compiled batch, one price, timed or not: ``target_s``)
    tail = ctx.cost.target_s(requests, requests)  # a plain step at the batch's end
    fewer = ctx.cost.target_s(requests - 1, requests - 1)
    return min(max(requests * (tail - fewer) / tail, 0.0), 1.0)


def drafts_worth(batch: float, tokens: float, freed: float, least: float) -> float:
    """What a plan's ``tokens`` expected over a ``batch`` of requests (one each certain) are
    worth: the drafted ones at ``freed`` (``freed_value``), but in full as far as every request
    gains them (``least``: the least expected drafts of one request; 0 where some do not
    draft)."""
    if freed >= 1.0:
        return tokens
    return batch + max(freed * (tokens - batch), batch * least)


def batch_gain(left: Sequence[int], progress: Sequence[int]) -> int:
    """The drafts a step gained a batch with nobody queued, beyond a plain step's one token
    each: how many steps sooner its last request now finishes. ``left``: each request's tokens
    left before the step (``Request.tokens_left``); ``progress``: the tokens each committed.
    Summed over steps it telescopes to exactly how much sooner the batch ends, whichever request
    is last; requests tied at the start gain the batch, each step, only what the one that did
    worst gained. (``queue_gain`` with nobody queued, every request in the step.)"""
    return queue_gain(left, progress, (), len(left))


def work_end(left: Sequence[int], queued: Sequence[int], slots: int) -> int:
    """Steps until the work the engine knows ends at one token a step: running requests with
    ``left`` tokens each, then ``queued`` ones in order, each into the slot that frees first
    (``slots`` in all)."""
    loads = sorted([*left, *[0] * max(slots - len(left), 0)])
    for n in queued:
        heapq.heapreplace(loads, loads[0] + n)
    return max(loads, default=0)


def queue_gain(
    left: Sequence[int], progress: Sequence[int], queued: Sequence[int], slots: int
) -> int:
    """The steps by which a drafting step brought the end of the known work (``work_end``)
    closer than a plain step would have: ``left`` each running request's tokens left before
    the step, ``progress`` the tokens each committed (0: not in this step's pass)."""
    plain = [n - min(p, 1) for n, p in zip(left, progress, strict=True)]
    done = [max(n - p, 0) for n, p in zip(left, progress, strict=True)]
    return max(work_end(plain, queued, slots) - work_end(done, queued, slots), 0)


def probe_outcome(r: Request) -> tuple[int, int] | None:
    """A shadow draft's answer, once the tokens ``r`` committed after it decide it: (draft slots
    compared, drafts accepted) — the drafts that match those tokens up to the first miss are what
    verifying the block would have accepted. None while undecided (no miss yet, the block not
    all matched, the request not finished)."""
    compared, accepted, decided = shadow_progress(r)
    return (compared, accepted) if decided else None


def shadow_progress(r: Request) -> tuple[int, int, bool]:
    """A shadow draft's answer so far: (draft slots compared, drafts accepted, decided) — the
    matches up to the first miss among the tokens ``r`` committed after it; decided at a miss,
    when the block all matched, or when the request finished."""
    assert r.shadow is not None
    start, drafts = r.shadow  # drafts[i] stands for output_ids[start + i]
    got = r.output_ids[start : start + len(drafts)]
    n = 0
    while n < len(got) and got[n] == drafts[n]:
        n += 1
    if n < len(got):  # a miss at slot n + 1
        return n + 1, n, True
    return n, n, n == len(drafts) or r.finished


def rank_slots(
    reqs: list[Request], survival: dict[int, list[float]]
) -> list[tuple[float, int, int]]:
    """(survival, request id, width) of every draft slot, highest survival first (stable, so a
    request's slots of equal survival stay in slot order)."""
    return sorted(
        ((s, id(r), i + 2) for r in reqs for i, s in enumerate(survival[id(r)])),
        key=lambda c: -c[0],
    )


def make_policy(name: str, block_size: int) -> Policy:
    if name == "ar":
        return ArPolicy()
    if name == "fixed":
        return Policy()
    if name == "head":
        return HeadPolicy()
    if name == "cost":
        return CostPolicy(block_size)
    raise ValueError(f"unknown policy {name!r}")
