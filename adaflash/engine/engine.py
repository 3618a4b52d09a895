"""The AdaFlash engine: continuous batching around one speculative round per step.

Each ``step()``: commands apply (adds, aborts, hot swaps, policy changes), the ``Scheduler``
picks who runs, ``round.speculative_round`` runs the algorithm (SPEC §1, §5; paper §3.2–3.3),
and the engine builds what users and the trainer see around its result: stop rules, streamed
tokens, round and request records, finished requests. All mutation happens on the thread that
calls ``step()``; other threads talk to the engine through ``add_request`` / ``abort`` /
``swap_drafter`` / ``set_policy``, which enqueue commands applied between steps — so a hot swap
never interrupts a round.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import os
import queue
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from adaflash.config import DEFAULT_BLOCK_SIZE, POLICIES, EngineConfig, SamplingParams
from adaflash.cost_model import CostModel
from adaflash.engine.detokenize import cut_at_stop
from adaflash.engine.policy import (
    Policy,
    PolicyContext,
    batch_gain,
    make_policy,
    queue_gain,
    shadow_progress,
)
from adaflash.engine.records import NullSink, RecordSink, RequestRecord, RoundRecord
from adaflash.engine.request import (
    EventCallback,
    FeatureStore,
    Request,
    TokenEvent,
    check_request,
)
from adaflash.engine.round import Drafting, Propose, RoundResult, Verified, speculative_round
from adaflash.engine.scheduler import Admission, Scheduler
from adaflash.engine.suffix import GlobalSuffixes, Proposal, SuffixConfig, SuffixIndex, best
from adaflash.engine.suffix import shadow_progress as suffix_shadow_progress
from adaflash.metrics import SpecCounters
from adaflash.models import draft_graph
from adaflash.models.decode_graph import batch_sizes, compile_enabled
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.kv_cache import KVCache
from adaflash.models.target import TargetModel

log = logging.getLogger(__name__)

PROBE_LOG = 100_000  # answered probes the dashboard can chart (three numbers each: a few MB)

# oneDNN (bf16 matmuls on a CPU) caches a primitive per input shape, 1024 by default; packed
# batches change shape every step, so a serving process slowly fills that cache (measured:
# +100 MB of RSS over 5 minutes at 32 concurrent streams). A smaller cache bounds it.
ONEDNN_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_DEFAULT = "256"


def bound_onednn_cache() -> None:
    """Cap oneDNN's primitive cache unless the operator set it (read on its first use)."""
    os.environ.setdefault(ONEDNN_CACHE, ONEDNN_CACHE_DEFAULT)


@dataclass
class EngineStats:
    """Raw counters of the engine (timings in seconds)."""

    steps: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    swaps: int = 0
    request_errors: int = 0  # requests ended by an error while being served
    draft_errors: int = 0  # drafter passes that failed (those requests took a plain step)
    # the cost policy's predicted step time against the measured one, steps that drafted and
    # steps that did not (how well the online cost model prices what it chooses)
    predicted_drafting_s: float = 0.0
    measured_drafting_s: float = 0.0
    predicted_plain_s: float = 0.0
    measured_plain_s: float = 0.0
    # … and its expected tokens of the steps that drafted against the tokens they committed
    # (how well the acceptance profiles predict: a plan that expects more than it gets loses)
    expected_drafting_tokens: float = 0.0
    realised_drafting_tokens: float = 0.0
    # … of which steps in which every request drafted with nobody queued: the least request's
    # expected drafts they were planned at, and the drafts they gained the batch (``batch_gain``)
    whole_steps: int = 0
    whole_planned: float = 0.0
    whole_gained: float = 0.0
    # … and those with requests queued: steps the known work's end gained (``queue_gain``)
    queue_steps: int = 0
    queue_planned: float = 0.0
    queue_gained: float = 0.0
    # the cost policy's probes (shadow drafts checked against the tokens committed after them)
    probes: int = 0
    probe_slots: int = 0  # draft slots they compared …
    probe_accepted: int = 0  # … and those that matched (what verifying would have accepted)


@dataclass
class _Swap:
    drafter: DFlashDrafter
    version: str


@dataclass
class _SetPolicy:
    policy: str | None
    gamma: float | None


@dataclass
class _Abort:
    request_id: str | None  # None aborts every request


@dataclass
class _Add:
    req: Request


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None,
        cfg: EngineConfig,
        *,
        sink: RecordSink | None = None,
        drafter_version: str = "v0",
        detokenize: Callable[[list[int]], str] | None = None,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        if drafter is None and cfg.policy != "ar":
            raise ValueError(f"policy {cfg.policy!r} needs a drafter; pass one or use policy 'ar'")
        bound_onednn_cache()
        self.target, self.cfg = target, cfg
        self.sink: RecordSink = sink or NullSink()
        self.detokenize = detokenize
        self.eos = set(target.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.max_context = cfg.max_context or target.cfg.max_position_embeddings
        # a row per request the engine may run, reserved now: grown by doubling as requests
        # arrived, each growth copied the pool into a fresh cleared one, and page faults made
        # that ~0.1 s a growth mid-step (math C = 16, the policy study's process, Zen 4)
        self.cache: KVCache = target.new_cache(initial_rows=cfg.max_running_requests)
        self.drafting: Drafting | None = None
        self.features: FeatureStore | None = None
        self.version = "none"
        self.block_size = DEFAULT_BLOCK_SIZE
        if drafter is not None:
            self._install_drafter(self._serving_copy(drafter), drafter_version)
        self.policy: str = cfg.policy
        self._policy: Policy = make_policy(cfg.policy, self.block_size)
        self.gamma: float = cfg.gamma
        self.cost = CostModel()
        # suffix drafts (``engine/suffix.py``): the n-grams a request drafts from, and the
        # recently served sequences where ``cfg.suffix`` is "global"; a proposal may be wider
        # than the drafter's block (up to the widest compiled verification)
        self.suffix_cfg = SuffixConfig()
        self.history = GlobalSuffixes(self.suffix_cfg) if cfg.suffix == "global" else None
        # rounds verify up to the drafter's block or a suffix draft, whichever is wider
        width = max(self.block_size, self.suffix_cfg.max_draft + 1)
        self.counters = SpecCounters(width)
        # the same, per source of the drafts: the drafter's ("dflash") and suffix drafts
        self.source_counters = {s: SpecCounters(width) for s in ("dflash", "suffix")}
        self.stats = EngineStats()
        # each answered probe: (unix time, slots compared, accepted), the newest PROBE_LOG —
        # what the drafter would have given had it been verified (the dashboard's drafter τ)
        self.probe_log: deque[tuple[float, int, int]] = deque(maxlen=PROBE_LOG)
        self.admission = Admission(
            cfg.max_batch_tokens,
            cfg.ema_beta,
            n_hat=max(1.0, cfg.max_batch_tokens / self.block_size),
        )
        self.scheduler = Scheduler(cfg.max_running_requests, self.admission)
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._suspects: set[int] = set()  # requests to run alone after a failed shared pass
        self._request_graphs()

    def _request_graphs(self) -> None:
        """With ``cfg.compile``: the compiled steps for what this engine now runs (plain
        decoding, or capturing the drafter's context; one request, and batched decode steps up
        to ``max_running_requests``, with a drafting policy verification of one request and of
        several), compiled in the background."""
        if not (self.cfg.compile and compile_enabled()):
            return
        batches = batch_sizes(self.cfg.max_running_requests)
        # plain steps capture the drafter's context (under ``ar`` too: a later policy drafts
        # from it), and so does verification, compiled where a policy drafts
        multi = self.drafting is not None and self.policy != "ar"
        self.target.compile_decode(self.capture, multi, batches=batches)

    # -- thread-safe control surface ----------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        domain: str | None = None,
        on_event: EventCallback | None = None,
        on_finish: Callable[[RequestRecord], None] | None = None,
    ) -> str:
        """Validate and queue a request; raises ValueError with the reason if it cannot run."""
        params = params or SamplingParams()
        check_request(
            prompt_ids,
            params,
            self.target.cfg.vocab_size,
            self.max_context,
            self.detokenize is not None,
        )
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Request(rid, list(prompt_ids), params, domain, on_event, on_finish)
        self._commands.put(_Add(req))
        return rid

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        self._commands.put(_Abort(None))

    def swap_drafter(self, drafter: DFlashDrafter, version: str) -> None:
        """Queue a hot swap of drafter + length head; it takes effect between two steps."""
        drafter.cfg.check_target(self.target.cfg)
        if self.drafter is not None:
            old = self.drafter.cfg
            if (drafter.cfg.target_layer_ids, drafter.cfg.block_size) != (
                old.target_layer_ids,
                old.block_size,
            ):
                raise ValueError(
                    "a hot swap must keep target_layer_ids and block_size: requests in flight "
                    "carry context features for the current layers"
                )
        # the serving copy is made and packed here, on the caller's thread, so the step that
        # installs it does not stall on it
        self._commands.put(_Swap(self._serving_copy(drafter), version))

    def set_policy(self, policy: str | None = None, gamma: float | None = None) -> None:
        if policy is not None and policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy not in (None, "ar") and self.drafter is None:
            raise ValueError(f"policy {policy!r} needs a drafter; none is loaded")
        if gamma is not None and gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self._commands.put(_SetPolicy(policy, gamma))

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or not self._commands.empty())

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def capture(self) -> tuple[int, ...]:
        """The target layers every pass captures: the drafter's context layers, if any."""
        return () if self.drafting is None else tuple(self.drafting.drafter.cfg.target_layer_ids)

    @property
    def drafter(self) -> DFlashDrafter | None:
        return None if self.drafting is None else self.drafting.drafter

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduling step. Returns False when there was nothing to do.

        An error while serving one request ends that request alone (finish reason "error"):
        per-request work is guarded request by request; when the shared target pass fails,
        its requests are retried one per step until the one that fails alone is found."""
        self._apply_commands()
        self.scheduler.admit(self._on_admit)
        if not self.running:
            return False
        prefills = self.scheduler.prefills(self.cfg.max_prefill_tokens)
        chosen = self.scheduler.front()
        self._suspects &= {id(r) for r in self.running}
        if self._suspects:  # isolate: one suspect alone per step
            suspect = next(r for r in self.running if id(r) in self._suspects)
            prefills = [p for p in prefills if p.req is suspect]
            chosen = [suspect] if suspect.prefill_done else []
        graph = self.target.decode_graph  # what the cost model's tables time: the graphs now
        self.cost.compiled(*(((), 0, (), ()) if graph is None else graph.compiled(self.capture)))
        ctx = PolicyContext(
            self.block_size,
            self.gamma,
            self.cost,
            self.cfg.max_batch_tokens,
            sum(p.n for p in prefills),
            max((p.n for p in prefills), default=0),
            waiting=len(self.scheduler.waiting),
            proposals=self._suffix_proposals(chosen),
        )
        res = speculative_round(
            self.target,
            self.cache,
            self.drafting,
            chosen,
            prefills,
            self._policy,
            ctx,
            self.admission,
        )
        if not res.passed:
            return False
        self.stats.draft_errors += int(res.draft_failed)
        if res.pass_error is None:
            self._check_prediction(res, chunk=bool(prefills))
            self.cost.observe_target(
                res.pass_tokens,
                len(res.passed),
                res.verify_ms / 1e3,
                prefill=bool(prefills),
                widest=res.pass_widest,
            )
            if res.drafted and not res.draft_failed:
                self.cost.observe_drafter(res.drafted, res.draft_ms / 1e3, res.draft_context)
        if res.pass_error is not None:
            self._pass_failed(res.passed, res.pass_error)
            return True
        self._suspects -= {id(r) for r in res.passed}
        for v in res.verified:
            self._commit_round(v, res)
        for r, token in res.first_tokens:
            self._guarded(r, functools.partial(self._emit, r, [token], ["target"]))
        for pre in prefills:
            self.stats.prompt_tokens += pre.n if pre.req in res.passed else 0
        for r, exc in res.failed:
            log.error("request %s failed in a step: %s", r.id, exc)
            self.stats.request_errors += 1
            if not r.finished:
                self._fail(r, f"internal error while serving this request: {exc}")
        for r in res.passed:
            if r.finished and r in self.running:
                self._finish(r)
        self.stats.steps += 1
        self.stats.draft_s += res.draft_ms / 1e3
        self.stats.verify_s += res.verify_ms / 1e3
        self.scheduler.rotate([v.plan.req for v in res.verified])  # round-robin
        return True

    def _suffix_proposals(self, reqs: list[Request]) -> dict[int, Proposal]:
        """This step's suffix drafts of ``reqs`` (where the policy weighs them): the longer
        match of a request's own tokens and the served history. Each becomes the request's
        suffix shadow, which the tokens it commits next decide (``_observe_suffix``)."""
        if self.cfg.suffix == "off" or not self._policy.uses_suffix or self.drafting is None:
            return {}
        out = {}
        for r in reqs:
            if not r.prefill_done or r.tokens_left < 2 or not r.output_ids:
                continue
            if r.suffix is None:
                r.suffix = SuffixIndex(self.suffix_cfg, r.prompt_ids + r.output_ids)
            limit = min(self.suffix_cfg.max_draft, r.tokens_left - 1)
            own = r.suffix.propose(limit)
            other = None if self.history is None else self.history.propose(r.suffix.tokens, limit)
            found = best(own, other)
            r.suffix_shadow = None
            if found is not None:
                out[id(r)] = found
                r.suffix_shadow = (len(r.output_ids), found.tokens, found.match, 0)
        return out

    def _observe_suffix(self, r: Request) -> None:
        """The slots of ``r``'s suffix shadow that its committed tokens decided since."""
        if r.suffix_shadow is None:
            return
        start, drafts, match, counted = r.suffix_shadow
        decided, right = suffix_shadow_progress(r.output_ids, start, drafts)
        if decided > counted:
            self._policy.observe_suffix(match, counted, decided, right)
        done = right < decided or decided == len(drafts) or r.finished
        r.suffix_shadow = None if done else (start, drafts, match, decided)

    def _check_prediction(self, res: RoundResult, *, chunk: bool) -> None:
        """The policy's plan for this step against what it took and committed (``chunk``: a
        prompt chunk was in the pass)."""
        predicted = self._policy.predicted_s
        # a failed drafter pass, or requests deferred over the budget: not what was planned
        if predicted is None or res.draft_failed or res.deferred:
            return
        measured = (res.draft_ms + res.verify_ms) / 1e3
        expected = self._policy.expected_tokens
        committed = sum(1 + v.accepted for v in res.verified)
        if any(v.plan.verify_len > 1 for v in res.verified):  # drafts verified (not probes)
            # beside a prompt chunk the chunk's eager pass is most of the price and its error
            # (priced 1.07 s, took 0.46 s): not what drafting steps take, so no time learnt
            # nor from a pass priced on a compiled graph not timed yet (``CostModel.untimed``):
            # that price was a guess to try it, not a prediction
            priced = 0.0 if chunk or self._policy.untimed else predicted
            self.cost.observe_drafting_step(priced, measured)
            least = self._policy.whole_least
            if least is not None:  # every request drafted, nobody queued: what the batch got
                left = [v.plan.req.tokens_left for v in res.verified]
                gained = batch_gain(left, [1 + v.accepted for v in res.verified])
                self.cost.observe_whole_step(least, gained)
                self.stats.whole_steps += 1
                self.stats.whole_planned += least
                self.stats.whole_gained += gained
            elif self.waiting:  # others queued: what the known work's end gained
                self._measure_queue_step(res, max((expected or 0.0) - len(res.verified), 0.0))
        else:
            self.cost.plain_step()
            if self.waiting:
                self.cost.queue_idle_step()
        if res.drafted:
            self.stats.predicted_drafting_s += predicted
            self.stats.measured_drafting_s += measured
            if expected is not None:
                self.stats.expected_drafting_tokens += expected
                self.stats.realised_drafting_tokens += committed
        else:
            self.stats.predicted_plain_s += predicted
            self.stats.measured_plain_s += measured

    def _measure_queue_step(self, res: RoundResult, planned: float) -> None:
        """A drafting step with requests queued (before its tokens are committed): the steps
        it brought the end of the known work closer (``queue_gain``) against the drafts
        planned."""
        progress = {id(v.plan.req): 1 + v.accepted for v in res.verified}
        gained = queue_gain(
            [r.tokens_left for r in self.running],
            [progress.get(id(r), 0) for r in self.running],
            [r.tokens_left for r in self.waiting],
            self.cfg.max_running_requests,
        )
        self.cost.observe_queue_step(planned, gained)
        self.stats.queue_steps += 1
        self.stats.queue_planned += planned
        self.stats.queue_gained += gained

    def _commit_round(self, v: Verified, res: RoundResult) -> None:
        """Stream what a verified request committed (stop rules applied) and record the round."""
        r, plan = v.plan.req, v.plan
        r.rounds += 1
        r.accepted += v.accepted
        r.verified += plan.verify_len - 1
        r.draft_ms += res.draft_ms if plan.drafted else 0.0
        r.verify_ms += res.verify_ms
        if plan.source == "dflash":  # suffix rounds teach the suffix profile (their shadow)
            self._policy.observe(r, plan.verify_len, v.accepted, self.block_size)
        emitted = self._guarded(r, lambda: self._emit(r, v.tokens, v.kinds)) or 0
        if r.shadow is not None:
            self._answer_probe(r)
        self.counters.add_round(plan.verify_len, v.accepted, plan.drafted)
        if plan.verify_len > 1:
            self.source_counters[plan.source].add_round(plan.verify_len, v.accepted, plan.drafted)
        self.sink.offer(
            RoundRecord(
                request_id=r.id,
                round_index=r.rounds - 1,
                drafter_version=self.version,
                policy=self.policy,
                block_size=self.block_size,
                verify_len=plan.verify_len,
                accepted=v.accepted,
                emitted=emitted,
                a_hat=plan.a_hat,
                batch_size=len(res.verified),
                draft_ms=res.draft_ms,
                verify_ms=res.verify_ms,
                timestamp=time.time(),
                domain=r.domain,
            )
        )

    def _answer_probe(self, r: Request) -> None:
        """Check ``r``'s shadow draft against what it committed since: the slots decided so far
        join its profile at once (a draft that keeps matching is not left unanswered for the
        block's 15 steps), the whole answer once decided."""
        compared, accepted, decided = shadow_progress(r)
        if not decided:
            if compared > r.shadow_seen:
                self._policy.observe_shadow(r, r.shadow_seen, compared, accepted, self.block_size)
                r.shadow_seen = compared
            return
        r.shadow = None
        if compared:
            self._policy.observe_probe(r, compared, accepted, self.block_size, r.shadow_seen)
            self.stats.probes += 1
            self.stats.probe_slots += compared
            self.stats.probe_accepted += accepted
            self.probe_log.append((time.time(), compared, accepted))

    def _guarded(self, r: Request, fn: Callable[[], int]) -> int | None:
        """Run one request's part of a step (a callback may raise): an exception ends that
        request alone, with the reason."""
        try:
            return fn()
        except Exception as exc:
            log.exception("request %s failed in a step", r.id)
            self.stats.request_errors += 1
            if not r.finished:
                self._fail(r, f"internal error while serving this request: {exc}")
            return None

    def _pass_failed(self, reqs: list[Request], exc: Exception) -> None:
        """The shared target pass raised (the round rolled its cache writes back): a lone
        request fails, several become suspects that run alone until the culprit is found."""
        log.error("target pass over %d requests failed: %s", len(reqs), exc)
        if len(reqs) == 1:
            self.stats.request_errors += 1
            self._fail(reqs[0], f"internal error while serving this request: {exc}")
            self._suspects.discard(id(reqs[0]))
        else:
            self._suspects |= {id(r) for r in reqs}

    def _fail(self, r: Request, error: str) -> None:
        r.finish_reason = "error"
        if r.on_event is not None:
            r.on_event(TokenEvent(r.id, (), (), True, "error", error))
        self._finish(r)

    def _emit(self, r: Request, tokens: list[int], kinds: list[str]) -> int:
        """Append tokens until a stop condition; stream them. Returns how many were emitted."""
        n, reason, stop_text = cut_at_stop(
            r.output_ids, tokens, r.params, self.eos, self.detokenize
        )
        out_ids, out_kinds = tokens[:n], kinds[:n]
        r.output_ids.extend(out_ids)
        if r.suffix is not None:
            r.suffix.extend(out_ids)
        if reason is not None:
            r.finish_reason = reason
        self._observe_suffix(r)
        if stop_text is not None:
            r.stop_text = stop_text
        self.stats.output_tokens += len(out_ids)
        if r.on_event is not None:
            r.on_event(
                TokenEvent(r.id, tuple(out_ids), tuple(out_kinds), r.finished, r.finish_reason)
            )
        return len(out_ids)

    def _finish(self, r: Request) -> None:
        if self.history is not None and r.output_ids and r.finish_reason != "error":
            self.history.add(r.prompt_ids + r.output_ids)
        self.cache.free(r.slot)
        if self.drafting is not None:
            self.drafting.cache.free(r.draft_slot)
        if r.features is not None and self.features is not None:
            self.features.free(r.features)
        self.scheduler.remove(r)
        self.stats.requests_finished += 1
        text = r.stop_text
        if text is None and self.detokenize is not None:
            text = self.detokenize(r.output_ids)
        record = RequestRecord(
            request_id=r.id,
            prompt_ids=tuple(r.prompt_ids),
            output_ids=tuple(r.output_ids),
            output_text=text,
            finish_reason=r.finish_reason or "abort",
            drafter_version=r.drafter_version,
            domain=r.domain,
            temperature=r.params.temperature,
            rounds=r.rounds,
            verified=r.verified,
            accepted=r.accepted,
            created_at=r.created_at,
            finished_at=time.time(),
            draft_ms=r.draft_ms,
            verify_ms=r.verify_ms,
        )
        self.sink.offer(record)
        if r.on_finish is not None:
            r.on_finish(record)

    def _propose(self) -> Propose | None:
        """A stand-in for argmax drafting (tests and benchmarks override it); None: argmax."""
        return None

    def _on_admit(self, r: Request) -> None:
        r.slot = self.cache.allocate()
        if self.features is not None:
            r.features = self.features.allocate()
        r.drafter_version = self.version

    def _serving_copy(self, drafter: DFlashDrafter) -> DFlashDrafter:
        """A copy of ``drafter`` in the target's dtype with packed weights and its draft head
        built (shared with the version served now where it is the same; the caller's object
        may go on training)."""
        drafter.cfg.check_target(self.target.cfg)
        served = copy.deepcopy(drafter).to(device=self.target.device, dtype=self.target.dtype)
        served.eval().requires_grad_(False)
        served.prepare_inference(self.target.lm_head.weight, like=self.drafter)
        return served

    def _install_drafter(self, drafter: DFlashDrafter, version: str) -> None:
        """Serve ``drafter``, a ``_serving_copy``."""
        c = drafter.cfg
        if self.features is None:  # a hot swap keeps the layers, hence the width
            self.features = FeatureStore.reserve(
                c.num_features * self.target.cfg.hidden_size,
                self.target.dtype,
                rows=self.cfg.max_running_requests,
                positions=self.max_context,
            )
        cache = KVCache(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.target.dtype,
            self.target.device,
            initial_rows=self.cfg.max_running_requests,
        )
        graph = None
        if self.cfg.compile and compile_enabled():  # the compiled drafter pass, where it serves
            graph = draft_graph.shared()
            graph.request(drafter)
        self.drafting = Drafting(drafter, version, cache, self.features, self._propose(), graph)
        self.version, self.block_size = version, c.block_size
        if self.cfg.max_batch_tokens < c.block_size:
            raise ValueError(
                f"max_batch_tokens ({self.cfg.max_batch_tokens}) must hold one full block "
                f"({c.block_size} tokens)"
            )

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self.scheduler.waiting.append(cmd.req)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _Swap):
                self._install_drafter(cmd.drafter, cmd.version)
                for r in self.running:  # context KV depends on drafter weights: rebuild lazily
                    r.draft_slot, r.ctx_version, r.ctx_len = -1, None, 0
                    r.slot_seen, r.slot_ok, r.probe_gap = [], [], 0  # and so does its profile
                    r.shadow = None  # … and what its probe drafted
                self._policy = make_policy(self.policy, self.block_size)
                self.cost.new_drafter()
                self.stats.swaps += 1
                self._request_graphs()
            elif isinstance(cmd, _SetPolicy):
                if cmd.policy and cmd.policy != self.policy:
                    self.policy = cmd.policy
                    self._policy = make_policy(cmd.policy, self.block_size)
                    self._request_graphs()
                self.gamma = cmd.gamma or self.gamma

    def _abort(self, request_id: str | None) -> None:
        if request_id is None:
            for r in list(self.waiting) + list(self.running):
                self._abort(r.id)
            return
        for r in list(self.waiting):
            if r.id == request_id:
                r.finish_reason = "abort"
                self._notify_abort(r)
                self._finish(r)
                return
        for r in self.running:
            if r.id == request_id:
                r.finish_reason = "abort"
                self._notify_abort(r)
                self._finish(r)
                return

    def _notify_abort(self, r: Request) -> None:
        if r.on_event is not None:
            r.on_event(TokenEvent(r.id, (), (), True, "abort"))

    def fail_all(self, error: str) -> None:
        """Finish every request with an error (after an unexpected exception in a step)."""
        for r in list(self.waiting) + list(self.running):
            r.finish_reason = "error"
            if r.on_event is not None:
                r.on_event(TokenEvent(r.id, (), (), True, "error", error))
            self._finish(r)

    # -- synchronous convenience ---------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestRecord]:
        """Run prompts to completion on the calling thread (CLI, tests, benchmarks)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        results: dict[str, RequestRecord] = {}
        ids = [
            self.add_request(p, sp, on_finish=lambda rec: results.__setitem__(rec.request_id, rec))
            for p, sp in zip(prompts, plist, strict=True)
        ]
        while any(i not in results for i in ids):
            if not self.step() and not self.has_work:
                break
        return [results[i] for i in ids]
