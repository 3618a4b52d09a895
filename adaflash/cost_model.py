"""What a step costs on this machine, now: online estimates the cost-aware policy plans with.

    target pass   t ≈ a + b·tokens + c·requests    (verified + prefilled tokens; sequences in it)
    drafter pass  t ≈ d + e·requests + f·context   (context: target positions committed since a
                                                    request last drafted, projected in this pass)

Each is a linear model fitted by recursive least squares with exponential forgetting (λ), fed by
every real step, so it follows the machine as it is: another process sharing the cores, a
different thread count, a longer context. Nothing is hard-coded beyond a weak starting guess that
the first steps overwrite.

A target pass of one request with few tokens is not on that line: it may run on a compiled graph
(``models/decode_graph.py``: one token, or a verification padded up to a compiled width of 4, 8
or 16) at a fraction of the eager cost, and one more token can cross to a wider graph or to the
eager path. Those passes get a table instead, one running mean per token count; a count never
measured is interpolated between its measured neighbours (above the largest, the line, but never
below that largest's cost).
Plain passes of several requests (one token each: nobody verifies) may run on a compiled
batched graph, at half the eager cost or less, so they get a table of their own too, keyed by the
batch size that runs them: the compiled size a count pads up to (``compiled``: 15 requests run on
the batch-16 graph and cost what 16 do), else the count itself; a key not yet measured is
interpolated between measured keys as above, the line taken at the key (15 requests priced as
16 before that step is timed too). A plain price is what every drafting step is compared
against, and a policy that keeps drafting never measures it again. So ``plain_stale`` says when
its price was never measured or not for ``PLAIN_REFRESH`` passes, the cost policy then takes one
plain step to time it, and that late measurement counts for half the new price. (Priced from the
line instead — fitted on the passes that verify — the compiled batch-16 step, 34–37 ms, was
priced 62–80 ms in a probe with the oracle drafter at C = 16, and eager plain steps were
overpriced as well: ``plain_stale``.) When the number of compiled graphs changes, the tables
start over: what they measured ran another path. Passes of several requests in which some
verify run eager; each request count gets a line of its own over tokens, started from the
shared line and fed by that count's passes without prompt chunks, so prefills and other
concurrencies do not pull it. Neither it nor the shared line (while a count's own line is
cold) ever prices such a pass below the measured plain step of as many requests. With
one shared line, a perfect drafter still lost to plain decoding at 8 and 16 requests (0.98×,
0.90×, docs/results/compare), where drafting leaves a compiled batched step.
Passes of several requests that verify at most a compiled batched-verification width each run
compiled too (``DecodeGraph.batch_verify``: every request padded to the width), so they get a
table keyed like the graph that runs them, (batch size, width), whatever the tokens in them. A
key not yet measured is priced at the plain pass of as many requests: optimistic, so that the
first step where drafting would pay drafts and times it (priced off the eager line instead, it
would never be taken). The tables start over when a graph is added (above), so each key costs at
most one such step per set of graphs.
The steps that drafted are also checked against their price as a whole: ``drafting_bias`` is
their measured ÷ predicted seconds, decayed, and every drafting plan's seconds are scaled by it
(``observe_drafting_step``). Each part is fitted on its own, and a step that drafts has parts
the others do not (a drafter pass beside the target's, requests padded to a width); in a
lockstep study on a Zen 3 EPYC, math at 8 requests with the oracle drafter, drafting steps took
1.08× their prediction and the policy, drafting where it predicted a narrow gain, ran at 0.96×
``ar``. It is measured on drafting steps alone, so it fades back to 1 over plain steps
(``plain_step``): a value that stopped the drafting is tried again, and stops it again if it was
right. The tokens side has no such factor: a plan's tokens are the policy's estimates
(``CostPolicy.survival``). Until 2026-12-07 the drafting steps' committed ÷ expected tokens
scaled them too (``drafting_yield``), beside a per-slot calibration of the same kind; both were
learnt on drafting steps alone, which the policy takes where its estimates look best, so they
ran below 1 and took the drafting with them (one request, a drafter right half the time per
slot: width 4 every round 1.32× ``ar``, the policy with them 1.02×, without them and with its
profiles shrunk harder 1.22×; ``policy.DECAY``).
Where nobody is queued and every request drafts, a plan is worth its least request's expected
drafts for the whole batch (``policy.drafts_worth``), but the batch runs as long as the request
that ends up last: ``whole_yield`` is what such steps gained the batch (``policy.batch_gain``)
÷ what they were planned at, decayed, and it scales that least.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class RecursiveLeastSquares:
    """y ≈ θ·x, updated one observation at a time; old observations fade with λ per update,
    towards the prior.

    Kept in information form, R = P⁻¹: an update takes R to λ·R + (1 − λ)·R₀ + x·xᵀ (R₀ the
    prior's) and moves θ by R⁻¹·x times the error. Plain exponential forgetting (R to λ·R +
    x·xᵀ) lets P grow by 1/λ an update along any direction the observations never vary — a
    cost engine's drafter passes are one-request probes for hours, so base against per request
    — and after ~3,000 such updates its float arithmetic broke: P went negative and a
    one-request pass the fit had seen was priced 3.5× its time
    (``test_thousands_of_one_request_drafter_passes_keep_the_fit_sound``). Here such a
    direction returns to the prior's uncertainty and stays there, and one that observations
    inform follows the last ~1/(1 − λ) of them as before (the machine turning 2× slower: a
    12.5 ms price at 23.1 ms after 60 passes, plain forgetting 23.3).

    Plain floats, not tensors: two or three coefficients, updated every step and read ~100s of
    times a step by the policy (as tensors an update took ~15 µs, as floats ~6 µs; the
    information form's solve made a three-coefficient update 30.5 µs against 22.5 on a Zen 2
    EPYC)."""

    def __init__(
        self,
        prior: list[float],
        forget: float = 0.97,
        confidence: float = 10.0,
        nonnegative: bool = False,
        variance: list[float] | None = None,
    ) -> None:
        n = len(prior)
        self.theta = [float(v) for v in prior]
        # P₀ = diag(variance), else confidence · I; R₀ = P₀⁻¹, the prior's information
        diag = variance or [confidence] * n
        self.info = [[1.0 / diag[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        # (1 − λ)·R₀: what each update adds back of the prior (constant)
        self.floor = [[(1.0 - forget) * v for v in row] for row in self.info]
        self.forget = forget
        self.nonnegative = nonnegative  # θ kept ≥ 0 after each update (each part costs time)
        self.seen = 0

    @classmethod
    def relative(
        cls, prior: list[float], share: float, noise: float, **kwargs: Any
    ) -> RecursiveLeastSquares:
        """A fit whose prior is uncertain by ``share`` of each coefficient, against
        observations off by about ``noise`` (P is the prior's covariance over the noise's
        variance). An observation's error then moves each coefficient by its part of the
        prediction, so a direction the passes seen so far never varied keeps its prior ratio.
        With one ``confidence`` for all (P = c·I, c ≫ the coefficients²), the first few
        observations decide alone along their own direction: six one-request drafter passes,
        replayed in 20 orders, priced 8 requests catching up 813 positions at 0.40–3.90× the
        pass's measured time (0.37–4.69× under plain exponential forgetting); with this prior,
        1.66–1.67×."""
        return cls(prior, variance=[(share * v / noise) ** 2 for v in prior], **kwargs)

    @property
    def p(self) -> list[list[float]]:
        """P = R⁻¹, the coefficients' covariance over the noise's variance."""
        n = len(self.theta)
        cols = [solve(self.info, [1.0 if i == j else 0.0 for i in range(n)]) for j in range(n)]
        return [[cols[j][i] for j in range(n)] for i in range(n)]

    def pin(self, theta: list[float]) -> None:
        """Set θ (tests that fix costs instead of timing them)."""
        self.theta = [float(v) for v in theta]

    def predict(self, x: list[float]) -> float:
        return sum(c * v for c, v in zip(self.theta, x, strict=True))

    def update(self, x: list[float], y: float) -> None:
        # R ← λ·R + (1 − λ)·R₀ + x·xᵀ: positive definite; where no x informs R it tends to R₀
        lam = self.forget
        self.info = [
            [lam * rij + fij + xi * xj for rij, fij, xj in zip(row, floor, x, strict=True)]
            for row, floor, xi in zip(self.info, self.floor, x, strict=True)
        ]
        gain = solve(self.info, x)  # R⁻¹·x
        err = y - self.predict(x)
        self.theta = [t + g * err for t, g in zip(self.theta, gain, strict=True)]
        if self.nonnegative:
            self.theta = [max(t, 0.0) for t in self.theta]
        self.seen += 1


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """z with a·z = b, by Gaussian elimination with partial pivoting (a: n × n, n ≤ 3 here)."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for c in range(n):
        piv = max(range(c, n), key=lambda i: abs(m[i][c]))
        m[c], m[piv] = m[piv], m[c]
        for i in range(c + 1, n):
            f = m[i][c] / m[c][c]
            m[i] = [u - f * w for u, w in zip(m[i], m[c], strict=True)]
    z = [0.0] * n
    for i in reversed(range(n)):
        z[i] = (m[i][n] - sum(m[i][j] * z[j] for j in range(i + 1, n))) / m[i][i]
    return z


# a drafter pass's starting guess (seconds): base, per request, per context position caught up;
# each uncertain by DRAFTER_SHARE of itself against passes off by DRAFTER_NOISE. Measured
# (3-layer drafter, block 8, bf16, 2 threads): ~6 ms + ~4 ms a request + 0.03–0.08 ms a position
# on a Zen 2 EPYC, ~1.3 ms a request + ~0.004 ms a position on a Zen 5; a position costs about
# 1% of a request in multiply-adds (fc and the layers' K/V against 8 tokens through the layers
# and the draft head), so the per-position guess is 1% of the per-request one
DRAFTER_PRIOR = (0.005, 0.002, 0.00002)
DRAFTER_SHARE = 1.0
DRAFTER_NOISE = 0.001
ONE_REQUEST_MAX = 32  # one-request passes up to this many tokens have their own table entry
ONE_REQUEST_RATE = 0.1  # weight of a new measurement in a table entry's running mean
MIXED_SEEN = 3  # passes a request count's own line needs before it prices (else: the shared)
PLAIN_REFRESH = 64  # target passes after which a plain price is measured again (``plain_stale``)
REFRESH_RATE = 0.5  # weight of a measurement taken after its price went stale
BIAS_RATE = 0.1  # weight of a drafting step's measured ÷ predicted seconds in ``drafting_bias``
BIAS_RANGE = (0.5, 2.0)  # one step's ratio is clipped to this (a GC pause, a compile)
WHOLE_DECAY = 0.95  # per all-request drafting step: ``whole_yield`` follows its last ~20
WHOLE_PRIOR = 1.0  # planned drafts' worth of "as planned" it starts from
WHOLE_MAX = 1.5  # … and the most it may credit
QUEUE_DECAY = 0.95  # per drafting step with a queue: ``queue_yield`` follows its last ~20
QUEUE_RELAX = 0.98  # per plain step with a queue: its evidence fades towards the prior, so a
# yield that fell is tried again (at 0 no drafting step would ever measure it again)
DRAFTING_RELAX = 0.98  # per plain step: ``drafting_bias`` fades towards 1


@dataclass
class DecayedYield:
    """Gained ÷ planned over recent steps: both sums decay by ``decay`` per observed step and
    start from ``WHOLE_PRIOR`` of "as planned" (a yield of 1); ``value`` is capped at ``cap``."""

    decay: float
    cap: float
    relax_rate: float = 1.0  # per ``relax``: the share of the evidence kept (1: none fades)
    gained: float = WHOLE_PRIOR
    planned: float = WHOLE_PRIOR

    def observe(self, planned: float, gained: float) -> None:
        self.gained = self.decay * self.gained + gained
        self.planned = self.decay * self.planned + planned

    def relax(self) -> None:
        """A step without evidence: move ``1 − relax_rate`` of the way back to the prior (at
        a yield of 0 the policy would never plan a step that measures it again)."""
        back = (1.0 - self.relax_rate) * WHOLE_PRIOR
        self.gained = self.relax_rate * self.gained + back
        self.planned = self.relax_rate * self.planned + back

    @property
    def value(self) -> float:
        return min(self.gained / self.planned, self.cap)

    def reset(self) -> None:
        self.gained = self.planned = WHOLE_PRIOR


@dataclass
class CostModel:
    """Seconds per target pass and per drafter pass, learned from the engine's own steps."""

    # starting guesses (seconds): replaced within a few steps by what this machine measures
    target: RecursiveLeastSquares = field(
        default_factory=lambda: RecursiveLeastSquares([0.05, 0.002, 0.002])
    )
    drafter: RecursiveLeastSquares = field(
        default_factory=lambda: RecursiveLeastSquares.relative(
            list(DRAFTER_PRIOR), DRAFTER_SHARE, DRAFTER_NOISE, nonnegative=True
        )
    )  # base, per request, per context position to catch up: each ≥ 0 (a fit of a few passes
    # of one or two requests with long contexts once priced 16 requests at −20 ms a request)
    one_request: dict[int, float] = field(default_factory=dict)  # tokens → seconds
    plain: dict[int, float] = field(default_factory=dict)  # batch size run (``plain_key``) → s
    # plain_key → ``target_passes`` when a plain pass last measured it (1: one request's)
    plain_at: dict[int, int] = field(default_factory=dict)
    batches: tuple[int, ...] = ()  # compiled batch sizes plain passes pad up to (``compiled``)
    graphs: int = -1  # compiled graphs the tables were measured with (-1: not told yet)
    # compiled batched verification (``verify_key``): (batch size, width) → seconds
    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    verify_graphs: tuple[tuple[int, int], ...] = ()  # their (batch size, width), compiled
    widths: tuple[int, ...] = ()  # compiled one-request verification widths (``one_key``)
    # requests → t ≈ a + b·tokens over that many requests' passes where some verify (no prompts)
    mixed: dict[int, RecursiveLeastSquares] = field(default_factory=dict)
    target_passes: int = 0  # every target pass observed (line and tables)
    drafting_bias: float = 1.0  # drafting steps' measured ÷ predicted seconds, decayed
    # all-request drafting steps with nobody queued: drafts the batch as a whole gained and
    # the least request's expected drafts they were planned at (``whole_yield``)
    whole: DecayedYield = field(default_factory=lambda: DecayedYield(WHOLE_DECAY, WHOLE_MAX))
    # drafting steps with requests queued: steps the known work's end moved closer beyond a
    # plain step's, and the drafts they were planned at (``queue_yield``); a plain step with
    # requests queued relaxes it towards the prior
    queue: DecayedYield = field(
        default_factory=lambda: DecayedYield(QUEUE_DECAY, 1.0, relax_rate=QUEUE_RELAX)
    )

    def observe_target(
        self,
        tokens: int,
        requests: int,
        seconds: float,
        prefill: bool = False,
        widest: int | None = None,
    ) -> None:
        """A measured target pass; ``prefill``: some of its tokens were prompt chunks (the
        shared line learns from those, a request count's own line does not); ``widest``: the
        most tokens one request had in it (None: not known, the line)."""
        # a plain pass timed again after its price went stale counts for more (``plain_stale``)
        age = self.plain_age(requests) if tokens == requests else None
        rate = REFRESH_RATE if age is not None and age > PLAIN_REFRESH else ONE_REQUEST_RATE
        self.target_passes += 1
        table: dict[Any, float]  # a running mean per key
        key: Any
        if requests == 1 and tokens <= ONE_REQUEST_MAX:
            table, key = self.one_request, self.one_key(tokens)
        elif requests > 1 and tokens == requests:  # a plain batched pass
            table, key = self.plain, self.plain_key(requests)
        elif not prefill and (vkey := self.verify_key(requests, widest)) is not None:
            table, key = self.verify, vkey  # a compiled batched verification
        else:
            if requests > 1 and not prefill:
                if requests not in self.mixed:  # starts where the shared line is
                    a, b, c = self.target.theta
                    self.mixed[requests] = RecursiveLeastSquares([a + c * requests, b])
                self.mixed[requests].update([1.0, float(tokens)], seconds)
            self.target.update([1.0, float(tokens), float(requests)], seconds)
            return
        if tokens == requests:
            self.plain_at[self.plain_key(requests)] = self.target_passes
        old = table.get(key)
        table[key] = seconds if old is None else old + rate * (seconds - old)

    def observe_drafter(self, requests: int, seconds: float, context: int = 0) -> None:
        self.drafter.update([1.0, float(requests), float(context)], seconds)

    def observe_drafting_step(self, predicted: float, measured: float) -> None:
        """A step in which some request verified drafts: the seconds it was priced at (drafter
        and target pass, unscaled) and the seconds it took. Their ratio, decayed, is
        ``drafting_bias``."""
        if predicted > 0:
            self.drafting_bias = drift(self.drafting_bias, measured / predicted, BIAS_RANGE)

    def plain_step(self) -> None:
        """A step that verified no drafts: ``drafting_bias`` moves ``1 − DRAFTING_RELAX`` of
        the way back to 1. It is measured on drafting steps alone, so a value that rose would
        otherwise stand for good once it stopped the drafting (the tokens' factor it once had
        beside it did: 0.75 priced the adapted drafter's plans — which measured 1.14× plain
        decoding at width 4 — at 0.81× the plain step, and the policy never drafted again;
        math, one request, Zen 4)."""
        self.drafting_bias = 1.0 + DRAFTING_RELAX * (self.drafting_bias - 1.0)

    def observe_whole_step(self, planned: float, gained: float) -> None:
        """A step in which every request drafted and nobody was queued: the least request's
        expected drafts it was planned at, and the drafts the batch as a whole gained
        (``policy.batch_gain``: how much sooner its last request will finish)."""
        self.whole.observe(planned, gained)

    def observe_queue_step(self, planned: float, gained: float) -> None:
        """A step in which some request verified drafts while others were queued: the drafts
        it was planned at (expected, unscaled) and the steps by which the end of the work the
        engine knows — running and queued requests, each to its token limit — came closer than
        a plain step would have brought it (``policy.queue_gain``)."""
        self.queue.observe(planned, gained)

    def queue_idle_step(self) -> None:
        """A step with requests queued that verified no drafts: ``queue_yield``'s evidence
        moves ``1 − QUEUE_RELAX`` of the way back to the prior."""
        self.queue.relax()

    @property
    def queue_yield(self) -> float:
        """What a drafted token is worth, lately, where requests are queued: a request that
        finishes sooner lets a queued one in sooner, but the work ends with the slot that ends
        last, so drafts spread over the slots gain what the slowest one gains (a closed batch
        of 8 requests at C = 4, shipped drafter on code: drafting in ~10 steps a run, its tokens
        as expected, saved 0–2 of ~770 steps). At most 1."""
        return self.queue.value

    @property
    def whole_yield(self) -> float:
        """What the batch gained per planned least drafts, lately: a batch with nobody queued
        runs as long as its last request, so all requests drafting gain it what the one that
        ends up last gains over the run, not what the least expects each step (sixteen
        requests tied at the start: each step, the one whose drafts did worst)."""
        return self.whole.value

    def new_drafter(self) -> None:
        """A new drafter version: what its plans gain a batch is not known yet (its time side,
        and every pass's price, still hold)."""
        self.whole.reset()
        self.queue.reset()

    @property
    def drafting_value(self) -> float:
        """What a drafting plan's expected tokens per predicted second are worth, lately: its
        predicted seconds over the measured ones (``drafting_bias``) — never above 1. Drafting
        steps that went faster than planned do not make the policy bet beyond its own
        estimates: it scales every token of a plan, the one each request is certain of
        included, so a value of 1.1 (learnt from a step beside a prompt chunk, priced at
        1.07 s, that took 0.46 s) made a plain step with a drafter pass beside it look 1.1×
        as good as the plain step (shipped drafter, code at C = 16, Zen 4)."""
        return min(1.0 / self.drafting_bias, 1.0)

    def compiled(
        self,
        batches: tuple[int, ...],
        graphs: int,
        verify: tuple[tuple[int, int], ...] = (),
        widths: tuple[int, ...] = (),
    ) -> None:
        """The engine's compiled steps now: the batch sizes plain passes pad up to (ascending),
        how many graphs there are, the batched verifications' (batch size, width) and the
        one-request verification widths. A new graph makes the tables start over (they timed
        another path)."""
        if graphs != self.graphs:
            self.one_request.clear()
            self.plain.clear()
            self.plain_at.clear()
            self.verify.clear()
        self.batches, self.graphs, self.verify_graphs = batches, graphs, verify
        self.widths = widths

    def one_width(self, tokens: int) -> int | None:
        """The compiled one-request verification width that runs ``tokens`` (every count padded
        up to it runs that graph and costs what it costs), else None (``verification_width``)."""
        return verification_width(self.widths, tokens)

    def one_key(self, tokens: int) -> int:
        """The one-request table's key for a pass of ``tokens``: its compiled width, else the
        count itself (one token, or eager)."""
        return self.one_width(tokens) or tokens

    def untimed(self, tokens: int, requests: int, widest: int | None = None) -> bool:
        """Whether ``target_s`` prices this pass optimistically: a compiled verification (one
        request's width, or a batched one) not timed yet, priced at its plain step."""
        if requests == 1:
            width = self.one_width(tokens)
            return width is not None and width not in self.one_request
        vkey = self.verify_key(requests, widest)
        return vkey is not None and vkey not in self.verify

    def verify_key(self, requests: int, widest: int | None) -> tuple[int, int] | None:
        """The compiled batched verification that runs a pass of ``requests`` whose widest
        request has ``widest`` tokens: the smallest batch size, then width, that hold it (as
        ``DecodeGraph.batch_verify`` picks); None where it runs eager."""
        if requests < 2 or widest is None or widest < 2:
            return None
        return batched_verification(self.verify_graphs, requests, widest)

    def plain_key(self, requests: int) -> int:
        """The batch size a plain pass of ``requests`` runs at: 1 for one request (its own
        step, never a padded batch), else the compiled size it pads up to, else its own count."""
        if requests == 1:
            return 1
        return next((b for b in self.batches if b >= requests), requests)

    def plain_age(self, requests: int) -> int | None:
        """Target passes since the plain pass of ``requests`` was last timed (None: never)."""
        at = self.plain_at.get(self.plain_key(requests))
        return None if at is None else self.target_passes - at

    def plain_stale(self, requests: int) -> bool:
        """Whether the plain pass of ``requests`` (what a drafting step is compared against)
        was never measured, or not for ``PLAIN_REFRESH`` target passes. Compiled or eager
        alike: the line through verifying passes does not price a plain one (eager, 16
        requests on an AVX2 EPYC: plain steps took 189 ms while the policy, pricing them from
        the line and never taking one, drafted every step at 30–43 tok/s against ar's 55)."""
        age = self.plain_age(requests)
        return age is None or age > PLAIN_REFRESH

    def target_s(self, tokens: int, requests: int, widest: int | None = None) -> float:
        """Predicted seconds of a target pass (never below a microsecond); ``widest``: the
        most tokens one request has in it (None: not known). An eager pass in which some
        verify is never priced below the measured plain pass of as many requests: a line
        fitted elsewhere (other request counts, nearly one token count) can tilt below it, and
        a cold model then drafted at 8 requests with nothing surviving (weak drafter, math:
        0.91× ``ar``, every drafting step an eager pass at twice the compiled plain one)."""
        if requests > 1 and tokens == requests:
            key = self.plain_key(requests)
            if key in self.plain:  # (measured: no line to compute, most calls)
                return self.plain[key]
            # not timed: the line at the batch it runs (15 requests pad up to the batch-16
            # step and cost what 16 do, timed or not)
            line = max(self.target.predict([1.0, float(key), float(key)]), 1e-6)
            return between(self.plain, key, line)
        vkey = self.verify_key(requests, widest)
        if vkey is not None:  # compiled: measured, else (optimistic) its plain pass (docstring)
            return self.verify.get(vkey) or self.target_s(requests, requests)
        table = self.one_request
        if requests == 1:
            width = self.one_width(tokens)
            key = width or tokens  # ``one_key``
            if key in table:
                return table[key]
            if width is not None:  # compiled, not timed yet: (optimistic) the one-token step
                # (priced on the eager line through prompt chunks instead, 2–4 tokens on the
                # width-4 graph were 36 ms against a 12 ms one-token step, where that graph
                # took 17.6: only a drafter of τ ≳ 3.5 would ever have drafted at one request;
                # AMX Xeon, docs/results/adapt/xeon_1207_epochs4/verify_widths_c1.json)
                return self.target_s(1, 1)
        mixed = self.mixed.get(requests)
        if requests > 1 and tokens > requests and mixed is not None and mixed.seen >= MIXED_SEEN:
            line = mixed.predict([1.0, float(tokens)])
        else:
            line = max(self.target.predict([1.0, float(tokens), float(requests)]), 1e-6)
        if requests == 1:
            return line if tokens > ONE_REQUEST_MAX else between(table, tokens, line)
        return max(line, self.plain.get(self.plain_key(requests), 1e-6))

    def drafter_s(self, requests: int, context: float = 0) -> float:
        """Predicted seconds of a drafter pass for ``requests`` that bring ``context`` new
        context positions to project (0 requests: no pass, no cost)."""
        if requests == 0:
            return 0.0
        return max(self.drafter.predict([1.0, float(requests), float(context)]), 1e-6)

    def snapshot(self) -> dict[str, float]:
        """The current estimates, for /metrics and the dashboard."""
        a, b, c = self.target.theta
        d, e, f = self.drafter.theta
        return {
            "target_base_ms": 1e3 * a,
            "target_per_token_ms": 1e3 * b,
            "target_per_request_ms": 1e3 * c,
            "drafter_base_ms": 1e3 * d,
            "drafter_per_request_ms": 1e3 * e,
            "drafter_per_context_token_ms": 1e3 * f,
            **{f"target_1req_{n}tok_ms": 1e3 * t for n, t in sorted(self.one_request.items())},
            **{f"target_plain_{n}req_ms": 1e3 * t for n, t in sorted(self.plain.items())},
            **{
                f"target_verify_{b}req_{w}wide_ms": 1e3 * t
                for (b, w), t in sorted(self.verify.items())
            },
            **{
                f"target_mixed_{n}req_{part}_ms": 1e3 * v
                for n, line in sorted(self.mixed.items())
                for part, v in zip(("base", "per_token"), line.theta, strict=True)
            },
            "drafting_bias": self.drafting_bias,
            "whole_yield": self.whole_yield,
            "queue_yield": self.queue_yield,
            "target_steps_seen": float(self.target_passes),
            "drafter_steps_seen": float(self.drafter.seen),
        }


def drift(value: float, ratio: float, bounds: tuple[float, float]) -> float:
    """``value`` moved ``BIAS_RATE`` of the way to ``ratio`` clipped to ``bounds``."""
    return value + BIAS_RATE * (min(max(ratio, bounds[0]), bounds[1]) - value)


def verification_width(widths: Iterable[int], tokens: int) -> int | None:
    """Of the compiled one-request verification widths, the one that runs ``tokens`` (≥ 2):
    the smallest that holds them; None where none does. The rule ``DecodeGraph.width`` runs by,
    and that the cost model prices by."""
    return min((w for w in widths if w >= tokens > 1), default=None)


def batched_verification(
    graphs: Iterable[tuple[int, int]], requests: int, widest: int
) -> tuple[int, int] | None:
    """Of the compiled batched verifications (batch size, width), the one that runs
    ``requests`` whose widest has ``widest`` tokens: the smallest batch size, then width, that
    holds them; None where none does. The rule ``DecodeGraph.batch_verify`` runs by, and that
    the cost model prices by."""
    return min(((b, w) for b, w in graphs if b >= requests and w >= widest), default=None)


def between(table: dict[int, float], key: int, line: float) -> float:
    """``table[key]``; a key not measured is interpolated between its measured neighbours;
    above every measured key, the line but at least the largest key's cost; below every one,
    the line but at most the smallest's; with nothing measured, the line."""
    if key in table:
        return table[key]
    if not table:
        return line
    known = sorted(table)
    i = bisect_left(known, key)
    if i == len(known):
        return max(line, table[known[-1]])
    hi = known[i]
    if i == 0:
        return min(line, table[hi])
    lo = known[i - 1]
    return table[lo] + (table[hi] - table[lo]) * (key - lo) / (hi - lo)
