"""One speculative round for a continuous batch (SPEC §1, §5; paper §3.2–3.3).

    draft_block → verify_len → drafts → admission → verify (one packed pass) → accept → commit

The policy's probes ride in the drafter pass as shadow drafts: drafted, never verified (their
requests take a plain step); the engine checks them against the tokens committed later.

``speculative_round`` is the whole algorithm of a step. It keeps the state it must keep
consistent — the target's KV cache and the drafter's context — and nothing else: it streams
nothing and records nothing. The engine builds stop rules, streaming and records around its
result. Prefill chunks ride in the same packed target pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from adaflash.decoding.acceptance import argmax_rows, greedy_accept, sampled_accept
from adaflash.decoding.sampling import sample_tokens
from adaflash.engine.policy import Policy, PolicyContext
from adaflash.engine.request import FeatureStore, Request
from adaflash.engine.scheduler import Admission, Prefill
from adaflash.models.draft_graph import DraftGraph
from adaflash.models.drafter import KV, BatchedContext, DFlashDrafter, NewContext
from adaflash.models.kv_cache import KVCache
from adaflash.models.target import PackedBatch, TargetModel, TargetOutput

log = logging.getLogger(__name__)


# (requests, drafter states (B, k, H), k̂ (B,)) → drafts per request (k̂_i − 1 each) and k̂
Propose = Callable[
    [list[Request], torch.Tensor, torch.Tensor], tuple[list[list[int]], torch.Tensor]
]


@dataclass
class Drafting:
    """The drafter and the context it keeps per request (owned by the engine). ``propose``
    turns drafter states into draft tokens: argmax over the draft vocabulary, unless a test or
    a benchmark stands in (an oracle drafter, an oracle length policy)."""

    drafter: DFlashDrafter
    version: str
    cache: KVCache  # per request: the drafter layers' context keys/values
    features: FeatureStore  # per request: raw target features of committed positions
    propose: Propose | None = None
    graph: DraftGraph | None = None  # the compiled drafter pass, where it serves


@dataclass
class Plan:
    """One request's part of this round's verification."""

    req: Request
    verify_len: int  # k̂, anchor included
    drafts: list[int]  # k̂ − 1 draft tokens
    drafted: int  # tokens the drafter proposed to verify (k − 1, or 0 without a draft)
    a_hat: float | None = None
    context: int = 0  # context positions its draft projected first (catch-up since last draft)
    shadow: bool = False  # a probe: in the drafter pass, its block kept in ``Request.shadow``
    source: str = "dflash"  # what drafted it: the drafter, or "suffix" (``engine/suffix.py``)


@dataclass
class Verified:
    """What one verified request committed."""

    plan: Plan
    accepted: int  # drafts accepted
    tokens: list[int]  # accepted drafts + the target's bonus token
    kinds: list[str]  # per token: "draft" (the drafter's), "suffix" or "target"


@dataclass
class RoundResult:
    verified: list[Verified] = field(default_factory=list)
    first_tokens: list[tuple[Request, int]] = field(default_factory=list)  # prompt completed
    deferred: list[Request] = field(default_factory=list)  # over the budget: next step
    failed: list[tuple[Request, Exception]] = field(default_factory=list)  # this request only
    pass_error: Exception | None = None  # the shared target pass failed; nothing committed
    passed: list[Request] = field(default_factory=list)  # every request in the target pass
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    draft_failed: bool = False
    drafted: int = 0  # requests the drafter ran for (shadow drafts included)
    draft_context: int = 0  # context positions that drafter pass projected (catch-up)
    pass_tokens: int = 0  # tokens in the target pass
    pass_widest: int = 0  # the most tokens one request had in it


def speculative_round(
    target: TargetModel,
    cache: KVCache,
    drafting: Drafting | None,
    chosen: list[Request],
    prefills: list[Prefill],
    policy: Policy,
    ctx: PolicyContext,
    admission: Admission,
) -> RoundResult:
    res = RoundResult()
    t0 = time.perf_counter()
    # 1–3. draft_block, verify_len, drafts: one drafter pass for the requests the policy lets
    # draft (none: no drafter pass at all)
    plans, res.draft_failed = draft(target, drafting, chosen, policy, ctx)
    res.drafted = sum(1 for p in plans if (p.drafted or p.shadow) and p.source == "dflash")
    res.draft_context = sum(p.context for p in plans)
    t1 = time.perf_counter()
    # 4. admission: Σ k̂ under the verification budget; the rest wait for the next step
    fit = admission.pack([p.verify_len for p in plans])
    plans, res.deferred = plans[:fit], [p.req for p in plans[fit:]]
    admission.update(len(plans), len(res.deferred))
    res.passed = [p.req for p in plans] + [p.req for p in prefills]
    if not res.passed:
        return res
    res.pass_tokens = sum(p.verify_len for p in plans) + sum(p.n for p in prefills)
    res.pass_widest = max([p.verify_len for p in plans] + [p.n for p in prefills], default=0)
    # 5. verify: one packed target pass over every [anchor, drafts] and the prefill chunks
    try:
        out, rows = verify(target, cache, drafting, plans, prefills)
    except Exception as exc:  # undo its partial cache writes; the engine decides who fails
        for r in res.passed:
            cache.truncate(r.slot, r.anchor_pos if r.prefill_done else r.prefilled)
        res.pass_error = exc
        return res
    t2 = time.perf_counter()
    res.draft_ms, res.verify_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
    # 6–7. accept (longest agreeing prefix + bonus) and commit, request by request; the
    # committed positions' features join the drafter context together, in one copy
    kept: list[tuple[Request, int, int]] = []  # (request, first packed row, rows)
    for plan, row in zip(plans, rows[: len(plans)], strict=True):
        try:
            v = accept_and_commit(cache, plan, out, row)
            res.verified.append(v)
            kept.append((plan.req, row[0], v.accepted + 1))
        except Exception as exc:
            res.failed.append((plan.req, exc))
    for pre, row in zip(prefills, rows[len(plans) :], strict=True):
        try:
            kept.append((pre.req, row[0], pre.n))
            token = commit_prefill(pre, out, row)
            if token is not None:
                res.first_tokens.append((pre.req, token))
        except Exception as exc:
            res.failed.append((pre.req, exc))
    keep_features(drafting, out, kept, res)
    return res


def can_draft(r: Request, drafting: Drafting | None) -> bool:
    return drafting is not None and r.features is not None and r.tokens_left > 1


def pending_context(d: Drafting, r: Request) -> int:
    """Target positions whose features this request's next draft must project first."""
    if r.features is None:
        return 0
    done = r.ctx_len if r.ctx_version == d.version and r.draft_slot in d.cache else 0
    return d.features.length[r.features] - done


def draft(
    target: TargetModel,
    drafting: Drafting | None,
    reqs: list[Request],
    policy: Policy,
    ctx: PolicyContext,
) -> tuple[list[Plan], bool]:
    """Steps 1–3. A drafter failure costs this round its speculation, nothing more (those
    requests take a plain step; their context is rebuilt from raw features next time)."""
    plans = {id(r): Plan(r, 1, [], 0) for r in reqs}
    if drafting is not None:
        ctx.pending = lambda r: pending_context(drafting, r)
    ctx.requests = len(reqs)
    # the policy weighs suffix drafts (``ctx.proposals``) beside the drafter's: those it takes
    # verify their proposal and stay out of the drafter pass
    spec = policy.drafters([r for r in reqs if can_draft(r, drafting)], ctx)
    probes = list(policy.probes)
    for r in reqs:
        w = policy.suffix_widths.get(id(r), 1)
        if w > 1:
            drafts = list(ctx.proposals[id(r)].tokens[: w - 1])
            plans[id(r)] = Plan(r, w, drafts, len(drafts), source="suffix")
    ctx.plain_requests = len(reqs) - len(spec) - len(policy.suffix_widths)
    failed = False
    if (spec or probes) and drafting is not None:
        try:
            plans.update(draft_plans(target, drafting, spec, probes, policy, ctx))
        except Exception:
            log.exception("drafter pass failed; these requests take a plain step")
            failed = True
            for r in spec + probes:
                r.draft_slot, r.ctx_version, r.ctx_len, r.shadow = -1, None, 0, None
    return [plans[id(r)] for r in reqs], failed


def draft_plans(
    target: TargetModel,
    d: Drafting,
    spec: list[Request],
    probes: list[Request],
    policy: Policy,
    ctx: PolicyContext,
) -> dict[int, Plan]:
    """One drafter pass over ``spec`` (plans to verify) and ``probes`` (their whole blocks kept
    as ``Request.shadow``; their plans verify the anchor alone)."""
    k = d.drafter.cfg.block_size
    both = spec + probes
    catch_up = {id(r): pending_context(d, r) for r in both}
    with torch.inference_mode():  # every input of the compiled pass an inference tensor
        # 1. draft_block: [anchor, mask_token_id × (k−1)] at positions p … p+k−1
        block_ids = torch.full((len(both), k), d.drafter.cfg.mask_token_id)
        block_ids[:, 0] = torch.tensor([r.anchor for r in both])
        positions = torch.tensor([r.anchor_pos for r in both])[:, None] + torch.arange(k)
        block = target.embed_tokens(block_ids.to(target.device))  # (B, k, H)
        states, drafted = drafter_pass(target, d, both, block, positions)  # (B, k, H), (B, k−1)
        mine, shadow = states[: len(spec)], states[len(spec) :]
        shadow_drafts = None if drafted is None else drafted[len(spec) :]
        probed = propose(target, d, probes, shadow, k, shadow_drafts)
        for r, row in zip(probes, probed, strict=True):
            r.shadow, r.shadow_seen = (len(r.output_ids), row), 0
        plans = {id(r): Plan(r, 1, [], 0, None, catch_up[id(r)], shadow=True) for r in probes}
        if not spec:
            return plans
        # 2. verify_len: k̂ per request (policy), never beyond the tokens still allowed
        a_hat = d.drafter.length_head(mine) if policy.uses_head else None  # (B,)
        k_hat = policy.widths(spec, a_hat, ctx).clamp(1, k)
        k_hat = torch.minimum(k_hat, torch.tensor([r.tokens_left for r in spec]))
        # 3. drafts: argmax over the draft vocabulary on the mask slots to be verified
        if d.propose is not None:
            drafts, k_hat = d.propose(spec, mine, k_hat)
        elif drafted is not None:
            drafts = drafted[: len(spec)].tolist()
        else:
            drafts = draft_tokens(target, d.drafter, mine, int(k_hat.max()) - 1)
    return plans | {
        id(r): Plan(
            r,
            int(k_hat[i]),
            drafts[i][: int(k_hat[i]) - 1],
            k - 1,
            None if a_hat is None else float(a_hat[i]),
            catch_up[id(r)],
        )
        for i, r in enumerate(spec)
    }


def drafter_pass(
    target: TargetModel,
    d: Drafting,
    reqs: list[Request],
    block: torch.Tensor,  # (B, k, H)
    positions: torch.Tensor,  # (B, k)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafter's pass over ``reqs``: their final block states (B, k, H) and, where the
    compiled pass ran (``Drafting.graph``), every mask slot's draft (B, k − 1) with them —
    the context committed since each request's last draft projected in the same graph. Else
    the eager pass: the context caught up first, then the states alone (drafts: the caller)."""
    for r in reqs:
        context_slot(d, r)
    head = None if d.graph is None else d.drafter.head_panels(target.lm_head.weight)
    if d.graph is not None and head is not None:
        new = [new_features(d, r) for r in reqs]  # (n_b, K·H) each
        context = BatchedContext.stack([drafter_context(d, r) for r in reqs], min_length=2)
        fresh = NewContext.stack([(f, r.ctx_len) for f, r in zip(new, reqs, strict=True)])
        out = d.graph.draft(d.drafter, head, block, positions, context, fresh)
        if out is not None:
            states, index, new_kv = out  # new_kv: (B, layers, 2, kv, N, d)
            for b, (r, f) in enumerate(zip(reqs, new, strict=True)):
                append_context(d, r, new_kv[b, :, :, :, : f.shape[0]])
            return states, d.drafter.to_target_ids(index)
    catch_up_context(d, reqs)
    context = BatchedContext.stack([drafter_context(d, r) for r in reqs])
    return d.drafter.draft_states(block, positions, context), None


def propose(
    target: TargetModel,
    d: Drafting,
    reqs: list[Request],
    states: torch.Tensor,
    k: int,
    drafted: torch.Tensor | None = None,
) -> list[list[int]]:
    """The whole block's drafts (k − 1 each) from drafter states (B, k, H), or the pass's
    own drafts (B, k − 1) where it made them."""
    if not reqs:
        return []
    if d.propose is not None:
        return d.propose(reqs, states, torch.full((len(reqs),), k))[0]
    if drafted is not None:
        return drafted.tolist()
    return draft_tokens(target, d.drafter, states, k - 1)


def draft_tokens(
    target: TargetModel, drafter: DFlashDrafter, states: torch.Tensor, width: int
) -> list[list[int]]:
    """states (B, k, H) → draft tokens of slots 1 … width, per request."""
    b, _, h = states.shape
    if width <= 0:
        return [[] for _ in range(b)]
    # a 2-D contiguous input keeps torch on one GEMM (a 3-D slice can take a bmm path that
    # copies the whole LM-head weight); only the draft vocabulary's rows are scored
    rows = states[:, 1 : 1 + width].reshape(b * width, h).contiguous()  # (B·width, H)
    return drafter.argmax_drafts(rows, target.lm_head.weight).view(b, width).tolist()


class HasDrafter(Protocol):
    @property
    def target(self) -> TargetModel: ...

    @property
    def drafter(self) -> DFlashDrafter | None: ...


def stand_in(owner: HasDrafter, drafts: Callable[[Request, int], list[int]]) -> Propose:
    """A ``Propose`` whose drafts are ``drafts(request, width)`` — a benchmark's oracle or a
    drafter of known quality — while ``owner``'s drafter still scores its draft vocabulary
    over the states (output discarded), so a step costs what it would with a drafter that
    drafted them; k̂ as the policy chose."""

    def propose(
        reqs: list[Request], states: torch.Tensor, k_hat: torch.Tensor
    ) -> tuple[list[list[int]], torch.Tensor]:
        assert owner.drafter is not None
        width = int(k_hat.max()) - 1
        draft_tokens(owner.target, owner.drafter, states, width)  # the drafter's cost
        return [drafts(r, width) for r in reqs], k_hat

    return propose


def context_slot(d: Drafting, r: Request) -> None:
    """Give ``r`` a row of the drafter's context cache for the drafter version serving now (a
    fresh one, projected from position 0, after a swap or a failed pass)."""
    assert r.features is not None
    if r.ctx_version != d.version or r.draft_slot not in d.cache:
        r.draft_slot = d.cache.allocate()
        r.ctx_len, r.ctx_version = 0, d.version


def new_features(d: Drafting, r: Request) -> torch.Tensor:
    """Features (n, K·H) of the positions ``r`` committed since its context was projected."""
    assert r.features is not None
    return d.features.view(r.features, r.ctx_len)


def append_context(d: Drafting, r: Request, kv: torch.Tensor) -> None:
    """Append the keys/values (layers, 2, kv_heads, n, d) of ``r``'s next n positions."""
    n = kv.shape[3]
    d.cache.reserve(r.draft_slot, n)
    d.cache.write_layers(r.draft_slot, kv)
    d.cache.advance(r.draft_slot, n)
    r.ctx_len += n


def catch_up_context(d: Drafting, reqs: list[Request]) -> None:
    """The eager pass's first part: project the features each request committed since its
    last draft into its drafter context (the fused context c and every layer's keys/values),
    all requests in one call."""
    parts = [(r, new_features(d, r)) for r in reqs]  # (n, K·H) each
    parts = [(r, new) for r, new in parts if new.shape[0]]
    if not parts:
        return
    features = torch.cat([new for _, new in parts])  # (Σn, K·H)
    positions = torch.cat([torch.arange(r.ctx_len, r.ctx_len + len(new)) for r, new in parts])
    with torch.inference_mode():
        kv = d.drafter.context_layers(features, positions)  # (layers, 2, kv, Σn, d)
    start = 0
    for r, new in parts:
        append_context(d, r, kv[:, :, :, start : start + len(new)])
        start += len(new)


def drafter_context(d: Drafting, r: Request) -> list[KV]:
    """Context keys/values of every drafter layer, as far as projected."""
    return [d.cache.read(r.draft_slot, li) for li in range(d.drafter.cfg.num_layers)]


def verify(
    target: TargetModel,
    cache: KVCache,
    drafting: Drafting | None,
    plans: list[Plan],
    prefills: list[Prefill],
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
    capture = drafting.drafter.cfg.target_layer_ids if drafting is not None else ()
    out = target(
        batch,
        cache,
        capture_layers=tuple(capture),
        logits=torch.tensor(logit_rows, dtype=torch.long),
    )
    return out, rows


def accept_and_commit(
    cache: KVCache,
    plan: Plan,
    out: TargetOutput,
    row: tuple[int, int, int],
) -> Verified:
    r, (_, n, logit_first) = plan.req, row
    assert out.logits is not None
    logits = out.logits[logit_first : logit_first + n]  # (k̂, V)
    # 6. accept: longest agreeing prefix + the target's bonus token
    p = r.params
    acc = (
        greedy_accept(logits, plan.drafts)
        if p.greedy
        else sampled_accept(logits, plan.drafts, p.temperature, p.top_k, p.top_p, r.generator)
    )
    # 7. commit: keep anchor + accepted drafts in the KV cache (their features: ``keep_features``)
    cache.truncate(r.slot, r.anchor_pos + acc.accepted + 1)
    tokens = [*plan.drafts[: acc.accepted], acc.bonus_token]
    kind = "suffix" if plan.source == "suffix" else "draft"
    return Verified(plan, acc.accepted, tokens, [kind] * acc.accepted + ["target"])


def commit_prefill(pre: Prefill, out: TargetOutput, row: tuple[int, int, int]) -> int | None:
    """A prompt chunk is in the cache; when it was the last one, the target's first token."""
    r, (_, n, logit_row) = pre.req, row
    r.prefilled += n
    if not r.prefill_done:
        return None
    assert out.logits is not None
    logits = out.logits[logit_row : logit_row + 1]  # (1, V)
    p = r.params
    if p.greedy:
        return argmax_rows(logits)[0]
    return int(sample_tokens(logits, p.temperature, p.top_k, p.top_p, r.generator)[0])


def keep_features(
    drafting: Drafting | None,
    out: TargetOutput,
    kept: list[tuple[Request, int, int]],
    res: RoundResult,
) -> None:
    """Step 7 for the drafter context: the target features of the positions each request
    committed (``kept``: request, first packed row, rows), in one copy; should that fail, one
    request at a time, so that a failure ends that request alone."""
    if drafting is None or out.features is None:
        return
    # (request, its feature slot, first packed row, rows), for the requests that keep features
    mine = [(r, slot, first, n) for r, first, n in kept if (slot := r.features) is not None]
    try:
        drafting.features.append_many([(slot, f, n) for _, slot, f, n in mine], out.features)
    except Exception:
        log.exception("appending a step's features failed; appending them request by request")
        for r, slot, first, n in mine:
            try:
                drafting.features.append(slot, out.features[first : first + n])
            except Exception as exc:
                res.failed.append((r, exc))
