"""The AdaFlash engine: continuous batching around one speculative round per step.

Each ``step()`` runs one round for every admitted request (SPEC §1, §5; paper §3.2–3.3):

    draft_block → verify_len → drafts → admission → verify (one packed pass) → accept → commit

Prefill chunks of newly admitted requests ride in the same packed target pass. All mutation
happens on the thread that calls ``step()``; other threads talk to the engine through
``add_request`` / ``abort`` / ``swap_drafter`` / ``set_policy``, which enqueue commands applied
between steps — so a hot swap never interrupts a round.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from adaflash.config import DEFAULT_BLOCK_SIZE, POLICIES, EngineConfig, SamplingParams
from adaflash.decoding.acceptance import greedy_accept, sampled_accept
from adaflash.decoding.sampling import sample, target_probs
from adaflash.engine.detokenize import cut_at_stop
from adaflash.engine.records import NullSink, RecordSink, RequestRecord, RoundRecord
from adaflash.engine.request import (
    EventCallback,
    FeatureStore,
    Request,
    TokenEvent,
    check_request,
)
from adaflash.engine.scheduler import Admission
from adaflash.metrics import SpecCounters
from adaflash.models.drafter import KV, DFlashDrafter
from adaflash.models.kv_cache import KVCache
from adaflash.models.length_head import verify_len
from adaflash.models.target import PackedBatch, TargetModel, TargetOutput

log = logging.getLogger(__name__)

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


@dataclass
class _Plan:
    """One request's part of this step's verification."""

    req: Request
    verify_len: int  # k̂, anchor included
    drafts: list[int]  # k̂ − 1 draft tokens
    drafted: int  # tokens the drafter proposed (k − 1, or 0 without a draft)
    a_hat: float | None = None


@dataclass
class _Prefill:
    req: Request
    n: int  # prompt tokens in this chunk


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
        self.cache: KVCache = target.new_cache()
        self.drafter: DFlashDrafter | None = None
        self.draft_cache: KVCache | None = None
        self.features: FeatureStore | None = None
        self.version = "none"
        self.block_size = DEFAULT_BLOCK_SIZE
        if drafter is not None:
            self._install_drafter(drafter, drafter_version)
        self.policy: str = cfg.policy
        self.gamma: float = cfg.gamma
        self.counters = SpecCounters(self.block_size)
        self.stats = EngineStats()
        self.admission = Admission(
            cfg.max_batch_tokens,
            cfg.ema_beta,
            n_hat=max(1.0, cfg.max_batch_tokens / self.block_size),
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._suspects: set[int] = set()  # requests to run alone after a failed shared pass

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
        self._commands.put(_Swap(drafter, version))

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

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduling step. Returns False when there was nothing to do.

        An error while serving one request ends that request alone (finish reason "error"):
        per-request work is guarded request by request; when the shared target pass fails,
        its requests are rolled back and retried one per step until the one that fails alone
        is found."""
        self._apply_commands()
        self._admit()
        if not self.running:
            return False
        prefills = self._plan_prefill()
        ready = [r for r in self.running if r.prefill_done]
        chosen = ready[: self.admission.how_many(len(ready))]
        self._suspects &= {id(r) for r in self.running}
        if self._suspects:  # isolate: one suspect alone per step
            suspect = next(r for r in self.running if id(r) in self._suspects)
            prefills = [p for p in prefills if p.req is suspect]
            chosen = [suspect] if suspect.prefill_done else []

        t0 = time.perf_counter()
        plans = self._draft(chosen)  # steps 1–3: draft_block, verify_len, drafts
        t1 = time.perf_counter()
        fit = self.admission.pack([p.verify_len for p in plans])  # step 4: admission
        plans, deferred = plans[:fit], plans[fit:]
        self.admission.update(len(plans), len(deferred))
        if not plans and not prefills:
            return False
        try:
            out, rows = self._verify(plans, prefills)  # step 5: one packed target pass
        except Exception as exc:
            self._pass_failed([p.req for p in plans] + [p.req for p in prefills], exc)
            return True
        t2 = time.perf_counter()

        draft_ms, verify_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        for plan, row in zip(plans, rows[: len(plans)], strict=True):
            with self._guard(plan.req):
                self._accept_and_commit(plan, out, row, len(plans), draft_ms, verify_ms)  # 6–8
        for pre, row in zip(prefills, rows[len(plans) :], strict=True):
            with self._guard(pre.req):
                self._commit_prefill(pre, out, row)
        self._suspects -= {id(p.req) for p in plans} | {id(p.req) for p in prefills}

        self.stats.steps += 1
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        done = {id(p.req) for p in plans}
        self.running = [r for r in self.running if id(r) not in done] + [
            p.req for p in plans if not p.req.finished
        ]  # round-robin: served requests go to the back
        return True

    @contextlib.contextmanager
    def _guard(self, r: Request) -> Iterator[None]:
        """Run one request's part of a step; an exception ends that request with the reason."""
        try:
            yield
        except Exception as exc:
            log.exception("request %s failed in a step", r.id)
            self.stats.request_errors += 1
            if not r.finished:
                self._fail(r, f"internal error while serving this request: {exc}")

    def _pass_failed(self, reqs: list[Request], exc: Exception) -> None:
        """The shared target pass raised: undo its partial cache writes; a lone request fails,
        several become suspects that run alone until the culprit is found."""
        log.exception("target pass over %d requests failed", len(reqs))
        for r in reqs:
            committed = r.prefilled if not r.prefill_done else r.anchor_pos
            self.cache.truncate(r.slot, committed)
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

    def _draft(self, reqs: list[Request]) -> list[_Plan]:
        """Steps 1–3. One drafter pass for every request that speculates this step."""
        plans = {id(r): _Plan(r, 1, [], 0) for r in reqs}
        spec = [r for r in reqs if self._speculates(r)]
        if not spec:
            return [plans[id(r)] for r in reqs]
        try:
            plans.update(self._draft_plans(spec))
        except Exception:  # a drafter failure costs this step its speculation, nothing more
            log.exception("drafter pass failed; these requests take a plain step")
            self.stats.draft_errors += 1
            for r in spec:  # context rebuilt from raw features at the next draft
                r.draft_slot, r.ctx_version, r.ctx_len = -1, None, 0
        return [plans[id(r)] for r in reqs]

    def _draft_plans(self, spec: list[Request]) -> dict[int, _Plan]:
        """Steps 1–3 for the requests that speculate: one drafter pass for all of them."""
        assert self.drafter is not None
        k = self.block_size
        # 1. draft_block: [anchor, mask_token_id × (k−1)] at positions p … p+k−1
        block_ids = torch.full((len(spec), k), self.drafter.cfg.mask_token_id)
        block_ids[:, 0] = torch.tensor([r.anchor for r in spec])
        positions = torch.tensor([r.anchor_pos for r in spec])[:, None] + torch.arange(k)
        ctx = [self._drafter_context(r) for r in spec]
        with torch.inference_mode():
            block = self.target.embed_tokens(block_ids.to(self.target.device))  # (B, k, H)
            states = self.drafter(block, positions, ctx)  # (B, k, H)
            # 2. verify_len: k̂ per request (policy), never beyond the tokens still allowed
            a_hat = self.drafter.length_head(states) if self.policy == "head" else None
            if a_hat is not None:
                k_hat = verify_len(a_hat, k, self.gamma)
            else:
                k_hat = torch.full((len(spec),), k)
            k_hat = torch.minimum(k_hat, torch.tensor([r.tokens_left for r in spec]))
            # 3. drafts: argmax over the draft vocabulary on the mask slots to be verified
            drafts = self._draft_tokens(spec, states, int(k_hat.max()) - 1)
        return {
            id(r): _Plan(
                r,
                int(k_hat[i]),
                drafts[i][: int(k_hat[i]) - 1],
                k - 1,
                None if a_hat is None else float(a_hat[i]),
            )
            for i, r in enumerate(spec)
        }

    def _draft_tokens(
        self, reqs: list[Request], states: torch.Tensor, width: int
    ) -> list[list[int]]:
        """states (B, k, H) → draft tokens of slots 1 … width, per request."""
        if width <= 0:
            return [[] for _ in reqs]
        b, _, h = states.shape
        # a 2-D contiguous input keeps torch on one GEMM (a 3-D slice can take a bmm path that
        # copies the whole LM-head weight); only the draft vocabulary's rows are scored
        assert self.drafter is not None
        rows = states[:, 1 : 1 + width].reshape(b * width, h).contiguous()  # (B·width, H)
        best = self.drafter.draft_logits(rows, self.target.lm_head.weight).argmax(-1)  # (B·width,)
        return self.drafter.to_target_ids(best).view(b, width).tolist()  # (B, width)

    def _verify(
        self, plans: list[_Plan], prefills: list[_Prefill]
    ) -> tuple[TargetOutput, list[tuple[int, int, int]]]:
        """Step 5. One packed pass: Σ k̂_i verification tokens plus the prefill chunks.

        Returns the output and, per plan then per prefill, (first packed row, token count,
        first logits row)."""
        ids: list[int] = []
        slots: list[int] = []
        lengths: list[int] = []
        logit_rows: list[int] = []
        rows: list[tuple[int, int, int]] = []
        for p in plans:
            rows.append((len(ids), p.verify_len, len(logit_rows)))
            logit_rows.extend(range(len(ids), len(ids) + p.verify_len))
            ids += [p.req.anchor, *p.drafts]
            slots.append(p.req.slot)
            lengths.append(p.verify_len)
        for pre in prefills:
            r = pre.req
            rows.append((len(ids), pre.n, len(logit_rows)))
            ids += r.prompt_ids[r.prefilled : r.prefilled + pre.n]
            if r.prefilled + pre.n == len(r.prompt_ids):
                logit_rows.append(len(ids) - 1)
            slots.append(r.slot)
            lengths.append(pre.n)
        batch = PackedBatch(torch.tensor(ids), tuple(slots), tuple(lengths))
        capture = self.drafter.cfg.target_layer_ids if self.drafter is not None else ()
        out = self.target(
            batch,
            self.cache,
            capture_layers=tuple(capture),
            logits=torch.tensor(logit_rows, dtype=torch.long),
        )
        return out, rows

    def _accept_and_commit(
        self,
        plan: _Plan,
        out: TargetOutput,
        row: tuple[int, int, int],
        batch_size: int,
        draft_ms: float,
        verify_ms: float,
    ) -> None:
        r, (first, n, logit_first) = plan.req, row
        assert out.logits is not None
        logits = out.logits[logit_first : logit_first + n]  # (k̂, V)
        drafts = torch.tensor(plan.drafts, dtype=torch.long)
        # 6. accept: longest agreeing prefix + the target's bonus token
        p = r.params
        acc = (
            greedy_accept(logits, drafts)
            if p.greedy
            else sampled_accept(logits, drafts, p.temperature, p.top_k, p.top_p, r.generator)
        )
        # 7. commit: keep anchor + accepted drafts in the KV cache and the drafter context
        self.cache.truncate(r.slot, r.anchor_pos + acc.accepted + 1)
        if r.features is not None and self.features is not None and out.features is not None:
            self.features.append(r.features, out.features[first : first + acc.accepted + 1])
        tokens = [*plan.drafts[: acc.accepted], acc.bonus_token]
        kinds = ["draft"] * acc.accepted + ["target"]
        r.rounds += 1
        r.accepted += acc.accepted
        r.verified += plan.verify_len - 1
        r.draft_ms += draft_ms if plan.drafted else 0.0
        r.verify_ms += verify_ms
        emitted = self._emit(r, tokens, kinds)
        # 8. record
        self.counters.add_round(plan.verify_len, acc.accepted, plan.drafted)
        self.sink.offer(
            RoundRecord(
                request_id=r.id,
                round_index=r.rounds - 1,
                drafter_version=self.version,
                policy=self.policy,
                block_size=self.block_size,
                verify_len=plan.verify_len,
                accepted=acc.accepted,
                emitted=emitted,
                a_hat=plan.a_hat,
                batch_size=batch_size,
                draft_ms=draft_ms,
                verify_ms=verify_ms,
                timestamp=time.time(),
                domain=r.domain,
            )
        )
        if r.finished:
            self._finish(r)

    def _commit_prefill(self, pre: _Prefill, out: TargetOutput, row: tuple[int, int, int]) -> None:
        r, (first, n, logit_row) = pre.req, row
        if r.features is not None and self.features is not None and out.features is not None:
            self.features.append(r.features, out.features[first : first + n])
        r.prefilled += n
        self.stats.prompt_tokens += n
        if not r.prefill_done:
            return
        assert out.logits is not None
        logits = out.logits[logit_row : logit_row + 1]  # (1, V)
        p = r.params
        if p.greedy:
            token = int(logits.argmax(-1))
        else:
            token = int(sample(target_probs(logits, p.temperature, p.top_k, p.top_p), r.generator))
        self._emit(r, [token], ["target"])
        if r.finished:
            self._finish(r)

    # -- helpers -------------------------------------------------------------------------------
    def _speculates(self, r: Request) -> bool:
        return (
            self.policy != "ar"
            and self.drafter is not None
            and r.features is not None
            and r.tokens_left > 1
        )

    def _drafter_context(self, r: Request) -> list[KV]:
        """Context keys/values of every drafter layer, projecting features not yet projected."""
        assert self.drafter is not None and self.draft_cache is not None
        assert r.features is not None
        if r.ctx_version != self.version or r.draft_slot not in self.draft_cache:
            r.draft_slot = self.draft_cache.allocate()
            r.ctx_len, r.ctx_version = 0, self.version
        assert self.features is not None
        new = self.features.view(r.features, r.ctx_len)  # (n, K·H)
        if new.shape[0]:
            positions = torch.arange(r.ctx_len, r.ctx_len + new.shape[0])
            self.draft_cache.reserve(r.draft_slot, new.shape[0])
            with torch.inference_mode():
                for li, (k, v) in enumerate(self.drafter.context_kv(new, positions)):
                    self.draft_cache.write(r.draft_slot, li, k, v)
            self.draft_cache.advance(r.draft_slot, new.shape[0])
            r.ctx_len += new.shape[0]
        return [
            self.draft_cache.read(r.draft_slot, li) for li in range(self.drafter.cfg.num_layers)
        ]

    def _emit(self, r: Request, tokens: list[int], kinds: list[str]) -> int:
        """Append tokens until a stop condition; stream them. Returns how many were emitted."""
        n, reason, stop_text = cut_at_stop(
            r.output_ids, tokens, r.params, self.eos, self.detokenize
        )
        out_ids, out_kinds = tokens[:n], kinds[:n]
        r.output_ids.extend(out_ids)
        if reason is not None:
            r.finish_reason = reason
        if stop_text is not None:
            r.stop_text = stop_text
        self.stats.output_tokens += len(out_ids)
        if r.on_event is not None:
            r.on_event(
                TokenEvent(r.id, tuple(out_ids), tuple(out_kinds), r.finished, r.finish_reason)
            )
        return len(out_ids)

    def _finish(self, r: Request) -> None:
        self.cache.free(r.slot)
        if self.draft_cache is not None:
            self.draft_cache.free(r.draft_slot)
        if r.features is not None and self.features is not None:
            self.features.free(r.features)
        self.running = [x for x in self.running if x is not r]
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

    def _plan_prefill(self) -> list[_Prefill]:
        budget = self.cfg.max_prefill_tokens
        out = []
        for r in self.running:
            if r.prefill_done or budget == 0:
                continue
            n = min(len(r.prompt_ids) - r.prefilled, budget)
            out.append(_Prefill(r, n))
            budget -= n
        return out

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            r = self.waiting.popleft()
            r.slot = self.cache.allocate()
            if self.features is not None:
                r.features = self.features.allocate()
            r.drafter_version = self.version
            self.running.append(r)

    def _install_drafter(self, drafter: DFlashDrafter, version: str) -> None:
        drafter.cfg.check_target(self.target.cfg)
        drafter.to(device=self.target.device, dtype=self.target.dtype).eval()
        drafter.requires_grad_(False)
        c = drafter.cfg
        self.drafter, self.version, self.block_size = drafter, version, c.block_size
        self.draft_cache = KVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, self.target.dtype, self.target.device
        )
        if self.features is None:  # a hot swap keeps the layers, hence the width
            self.features = FeatureStore(
                c.num_features * self.target.cfg.hidden_size, self.target.dtype
            )
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
                self.waiting.append(cmd.req)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id)
            elif isinstance(cmd, _Swap):
                self._install_drafter(cmd.drafter, cmd.version)
                for r in self.running:  # context KV depends on drafter weights: rebuild lazily
                    r.draft_slot, r.ctx_version, r.ctx_len = -1, None, 0
                self.stats.swaps += 1
            elif isinstance(cmd, _SetPolicy):
                self.policy = cmd.policy or self.policy
                self.gamma = cmd.gamma or self.gamma

    def _abort(self, request_id: str | None) -> None:
        if request_id is None:
            for r in list(self.waiting) + list(self.running):
                self._abort(r.id)
            return
        for r in list(self.waiting):
            if r.id == request_id:
                self.waiting.remove(r)
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
        self.waiting.clear()

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
