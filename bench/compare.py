"""The paper's Table 1 on this machine, and a study of verify-width policies.

``--study paper`` (the default): speedup and τ per method, domain and concurrency. Methods,
measured on the same held-out prompts in one run (greedy, bf16, SmolLM2-135M target):

- ``ar``        plain autoregressive decoding through our runtime — the 1.0× reference
- ``hf``        Hugging Face ``generate`` on the same target (what a CPU user would otherwise run)
- ``hf-pld``    HF ``generate`` with prompt-lookup speculation (HF supports it at batch 1 only)
- ``dflash``    the shipped offline drafter, never updated, fixed k̂ = 16
- ``osd``       the drafter adapted online with the forward-KL (OSD) loss, fixed k̂ = 16
- ``adaflash``  the drafter adapted online with OPD + its online length head (``head`` policy)
- ``oracle``    the AdaFlash drafter with a length oracle that verifies exactly accepted + 1

Online adaptation: for each domain, ``--rounds`` rounds of on-policy training on that domain's
train prompts. At T = 0 the trajectories serving would log are the target's greedy outputs
whatever drafter served them (speculation is lossless), so they are generated once per domain
with plain decoding and fed to both online methods in the same chunks; the adaptation curve
(simulated τ on the eval trajectories after each round) is kept. Speed is a ratio to ``ar`` at
the same concurrency, measured in the same run. Results: JSON, a Markdown table and PNG charts.

``--study policies`` ("Speculation that never loses: cost-aware verification width"): no online
adaptation; the engine's verify-width policies, each with three drafters.

- methods: ``ar`` (1.0×), ``hf``, ``head`` (length head), ``cost`` (cost-aware: a request may
  not draft at all), ``oracle-len`` (k̂ = accepted + 1, needs the answer key), and with
  ``--gguf`` a peer row, ``llamacpp``: llama.cpp (``bench/llamacpp_peer.py`` in a process of its
  own, the optional ``bench`` extra; ``scripts/peer_models.sh`` builds it and the GGUF files) on
  the same prompts, C sequences at a time in one ``llama_decode`` batch, greedy, each prompt
  exactly ``--max-new-tokens`` tokens (EOS ignored, where our engine may stop earlier: the rows
  compare rates)
- drafters: ``shipped`` (``--drafter``), ``weak`` (the shipped config and draft vocabulary with
  random weights, ``--seed``: almost never right) and ``oracle`` (drafts are the target's own
  greedy continuation, at the shipped drafter's cost; its ``oracle-len`` row would repeat
  ``head``/``cost`` at full acceptance and is skipped). ``--criteria-only`` runs the rows
  the criteria read and no others: ``cost`` with each drafter, ``head`` and ``oracle-len`` with
  the shipped one (the weak and oracle drafters' ``head`` and ``oracle-len`` rows, at 0.25–0.5×
  ``ar``, took over half of a full run's time)
- ``--capture-row`` adds ``ar-capture``: the ``ar`` policy with the first drafter attached. It
  never drafts, but its plain steps run the graphs that keep the drafter's captured layers and
  it stores their features, as a speculative engine's plain steps do: between it and ``ar`` lies
  what keeping the drafter's context costs, between it and ``cost`` what the policy and its
  probes cost (its ``verify_s``, the target passes, against ``ar``'s)

The drafters run in ``--dtype`` as `serve` runs them, and the target's one-request steps run on
the compiled graphs `serve` builds (``models/decode_graph.py``: plain decode with and without the
drafter's captured layers, verification padded up to 4 / 8 / 16 tokens, batched decode steps),
compiled before any cell and timed apart (``compile_s``); ``--no-compile`` measures the eager
steps instead.

Every run is a fresh engine, but its cost model and its policy's engine-wide acceptance profile
carry over between the runs of the same (drafter, method, concurrency), across repeats and
domains, as in a server that has been up for a while (``--cold``: every run starts cold). Each
(domain, C) cell runs its methods ``--repeats`` times. The engine methods of a repeat run side
by side in one process, one step each in turn, each timed on its own steps (``run_lockstep``):
a slow phase of a shared machine then lands on every method alike, step by step; the peers
(``hf``, ``llamacpp``) run on their own before or after that block, in rotated order, and the
oracles' answer key comes from an untimed ``ar`` run of the cell first; where an oracle's output
leaves it (bf16 near-ties), its continuation is recomputed between steps, untimed
(``ReferenceEngine``; a row's ``resyncs`` counts them). ``--sequential``: each
method's run on its own, interleaved instead (rep 1: ar, hf, head, cost, …; rep 2: the same
order rotated, …), as the runs before 2026-12-03 were. A row keeps the median, min and max
tokens/s; ``speedup`` = median ÷ median ``ar`` of the cell, and ``speedup_min``/``speedup_max``
are the worst and best pairings (min ÷ max ``ar``, max ÷ min ``ar``). ``paired`` = the median
over repeats of run ÷ the same repeat's ``ar`` run (with its min and max): a slow spell that
lasts a repeat cancels out of it, so it is the sharper estimate where the machine drifts;
criterion (a) reads it. ``cost`` rows add the seconds of its steps that ran the drafter and of
its plain ones, its probes (shadow drafts) and their hit rate. ``table.md`` ends with pass/fail
criteria computed from the rows (``criteria``).
``--ignore-eos``: every reply runs to ``--max-new-tokens``, so every method does the same work.
Without it, a speculative engine's bf16 graphs (they capture the drafter's layers) can round a
near-tie differently from ``ar``'s, its replies end elsewhere, and a batch's rate moves with the
tokens it happened to produce while its length is set by its longest reply: in the run of
2026-12-03 on a Zen 3 EPYC, weak ``cost``'s paired rate followed its token count (chat C = 8: 716
tokens against ``ar``'s 743, 0.95×; blend C = 4: 763 against 713, 1.05×; where the outputs were
identical, at C = 1, 0.96–0.98×).
``--study both`` runs both studies.

    python bench/compare.py --quick                    # smoke check, < 10 min
    python bench/compare.py --out docs/results/compare # the full run (hours on 2 CPU cores)
    python bench/compare.py --study policies --quick   # policy-study smoke check, < 10 min
    python bench/compare.py --study policies           # → docs/results/compare-policies
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import itertools
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from adaflash.cli import DEFAULT_DRAFTER, encode_prompt
from adaflash.config import DistillConfig, EngineConfig, Policy, SamplingParams
from adaflash.cost_model import CostModel
from adaflash.distill import simulate_acceptance
from adaflash.engine import policy as policies
from adaflash.engine.engine import Engine
from adaflash.engine.records import RequestRecord
from adaflash.engine.request import Request
from adaflash.engine.round import Propose, draft_tokens, stand_in
from adaflash.hardware import cpu_info
from adaflash.metrics import speedup
from adaflash.models.decode_graph import batch_sizes, compile_now, compiled_route
from adaflash.models.drafter import DFlashDrafter, load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.paths import REPO, repo_relative
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import Trajectory, load_prompts
from lightning_modules.train import fit

SPEC_METHODS = ("dflash", "osd", "adaflash", "oracle")
STUDIES = ("paper", "policies", "both")
POLICY_DRAFTERS = ("shipped", "weak", "oracle")
# each with every drafter (+ ar, hf once); ``cost-dflash``: ``cost`` without suffix drafts
POLICY_METHODS = ("head", "cost", "cost-dflash", "oracle-len")
# ``--capture-row``: plain decoding with the drafter attached (module docstring)
CAPTURE_METHOD = "ar-capture"
ROW_METHODS = (CAPTURE_METHOD, *POLICY_METHODS)  # a drafter's rows in the tables, in this order
ENGINE_POLICY: dict[str, Policy] = {
    "ar": "ar",
    CAPTURE_METHOD: "ar",
    "head": "head",
    "cost": "cost",
    "cost-dflash": "cost",
    "oracle-len": "fixed",
}
SUFFIX_OFF = ("cost-dflash",)  # methods whose engines draft from the drafter alone
WEAK_FLOOR = 0.97  # criterion (a): cost with the weak drafter keeps this share of ar
ORACLE_SHARE = 0.90  # criterion (c): cost with the shipped drafter reaches this share of oracle-len

Refs = dict[tuple[int, ...], list[int]]  # prompt → the target's greedy continuation
Key = tuple[str | None, str]  # (drafter, method) of the policy study; ar/hf have no drafter


class ReferenceEngine(Engine):
    """An engine whose policy or drafts read the target's greedy continuation of each request
    (``references``, keyed by prompt), kept true to the run between steps by ``resync``.

    In bf16 the engine's own passes (a batch-8 verification, a batch-1 compiled step) can round
    a near-tie differently from the pass that computed the reference; a request's output then
    leaves it, and an oracle that went on reading it would be right no more (session 42: in 3 of
    4 AMX cells, 4–6 of 8 outputs left it, and the oracle rows said nothing of a ceiling).
    ``resync`` finds such requests and recomputes their continuation from their own output so
    far (plain decoding, untimed: callers run it outside the steps they time)."""

    def __init__(self, *args: Any, references: Refs, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.references = dict(references)  # this engine's own copy: resync rewrites it
        self.resyncs = 0  # continuations recomputed
        self._plain: Engine | None = None

    def reference(self, r: Request) -> list[int]:
        """The target's greedy continuation of ``r``'s prompt, as last computed."""
        return self.references.get(tuple(r.prompt_ids), [])

    def continuation(self, r: Request) -> list[int]:
        """The reference's tokens past ``r``'s output so far."""
        return self.reference(r)[len(r.output_ids) :]

    def resync(self) -> int:
        """Recompute the continuation of each running request whose output left its
        reference; returns how many."""
        stale = [r for r in self.running if self.reference(r)[: len(r.output_ids)] != r.output_ids]
        if not stale:
            return 0
        if self._plain is None:
            cfg = EngineConfig(policy="ar", max_running_requests=16)
            self._plain = Engine(self.target, None, cfg, eos_token_ids=tuple(self.eos))
        params = [
            replace(r.params, max_new_tokens=r.params.max_new_tokens - len(r.output_ids))
            for r in stale
        ]
        recs = self._plain.generate([r.prompt_ids + r.output_ids for r in stale], params)
        for r, rec in zip(stale, recs, strict=True):
            self.references[tuple(r.prompt_ids)] = r.output_ids + list(rec.output_ids)
        self.resyncs += len(stale)
        return len(stale)


class OracleLengthEngine(ReferenceEngine):
    """k̂ = accepted + 1 exactly: the best any length policy can do (needs the answer key)."""

    def _propose(self):  # type: ignore[no-untyped-def]
        def propose(reqs, states, k_hat):  # type: ignore[no-untyped-def]
            assert self.drafter is not None
            drafts = draft_tokens(self.target, self.drafter, states, int(k_hat.max()) - 1)
            k_hat = k_hat.clone()
            for i, (r, row) in enumerate(zip(reqs, drafts, strict=True)):
                ref = self.continuation(r)
                n = 0
                while n < len(row) and n < len(ref) and row[n] == ref[n]:
                    n += 1
                k_hat[i] = min(n + 1, int(k_hat[i]))
            return drafts, k_hat

        return propose


class OracleDrafterEngine(ReferenceEngine):
    """Drafts are the target's greedy continuation (``continuation``), widths the policy's k̂.

    The real drafter still runs and scores its draft vocabulary (its output is discarded), so a
    step costs what it would with a drafter that is always right. A request whose output left
    its reference drafts wrong until the next ``resync`` (one step, where its caller resyncs
    between steps), as a drafter that is nearly always right would."""

    def _propose(self) -> Propose:
        return stand_in(self, self.drafts)

    def drafts(self, r: Request, width: int) -> list[int]:
        row = self.continuation(r)[:width]
        return row + [0] * (width - len(row))  # past its end: rejected


@dataclass
class Setup:
    """What every measurement of a run shares."""

    target: TargetModel
    tok: Tokenizer
    hf: Any  # the HF model of the same target
    eos: list[int]
    params: SamplingParams
    args: argparse.Namespace
    llama: Any = None  # the llama.cpp peer (``--gguf``), a LlamaCppPeer
    # (drafter, method, concurrency) → the cost model and policy its runs share (not --cold)
    warm: dict[tuple[str | None, str, int], tuple[CostModel, policies.Policy]] = field(
        default_factory=dict
    )


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One engine's run alone, timed on its own steps (``run_lockstep`` with one engine)."""
    return run_lockstep({(None, ""): engine}, prompts, params)[(None, "")]


LOCKSTEP_SEED = 0  # the engines' order in each turn of ``run_lockstep``


def run_lockstep(
    engines: dict[Key, Engine],
    prompts: list[list[int]],
    params: SamplingParams,
    profiles: dict[Key, cProfile.Profile] | None = None,
) -> dict[Key, dict]:
    """The engines serve the same prompts side by side, one step each in turn, each timed on
    its own steps only: a slow spell of the machine lands on all of them alike, at the
    granularity of a step, not of a run (runs one after another, ±10–20% apart on a shared
    host, could not separate a 3% difference in three repeats). Each turn takes them in a new
    order (seeded), so none always steps first, or right after the same one. (Turns rotated
    by one until 2026-12-03 kept the cyclic order: each engine stepped right after the same
    other in all but one step of a turn — every ``cost`` engine right after a ``head``
    engine's eager passes, ``ar`` right after the oracle ``cost`` engine.) ``profiles``: each
    engine's steps run under a cProfile of its own, kept there (``bench/profile_study.py``)."""
    done: dict[Key, dict[str, RequestRecord]] = {key: {} for key in engines}
    ids = {
        key: [e.add_request(p, params, on_finish=finisher(done[key])) for p in prompts]
        for key, e in engines.items()
    }
    spent = dict.fromkeys(engines, 0.0)
    live = list(engines)
    order = random.Random(LOCKSTEP_SEED)
    while live:
        for key in order.sample(live, len(live)):
            e = engines[key]
            if isinstance(e, ReferenceEngine):  # untimed: its answer key kept true (class doc)
                e.resync()
            prof = None if profiles is None else profiles.setdefault(key, cProfile.Profile())
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            stepped = e.step()
            if prof is not None:
                prof.disable()
            spent[key] += time.perf_counter() - t0
            if len(done[key]) == len(prompts) or not (stepped or e.has_work):
                live.remove(key)
    return {
        key: engine_result(e, prompts, [done[key][i] for i in ids[key]], spent[key])
        for key, e in engines.items()
    }


def finisher(done: dict[str, RequestRecord]) -> Callable[[RequestRecord], None]:
    def finish(rec: RequestRecord) -> None:
        done[rec.request_id] = rec

    return finish


def engine_result(
    engine: Engine, prompts: list[list[int]], recs: list[RequestRecord], wall: float
) -> dict:
    """One run's figures: ``wall`` the seconds the engine's own steps took."""
    c, st = engine.counters, engine.stats
    return {
        "tokens_per_s": st.output_tokens / wall,
        "accept_len": c.accept_len,
        "verify_len": c.verify_len,
        "output_tokens": st.output_tokens,
        # where its time went: steps, the round's drafting part (policy included) and its target
        # pass; the rest of ``wall`` is accept, commit, features, records, scheduling
        "_timing": {"steps": st.steps, "draft": st.draft_s, "verify": st.verify_s},
        "_pricing": {  # the cost policy's predicted step time against the measured (seconds)
            "drafting": (st.predicted_drafting_s, st.measured_drafting_s),
            "plain": (st.predicted_plain_s, st.measured_plain_s),
            # its steps that drafted: tokens it expected of them against tokens they committed
            "tokens": (st.expected_drafting_tokens, st.realised_drafting_tokens),
            # its probes (shadow drafts): how many, draft slots they compared, found accepted
            "probes": (st.probes, st.probe_slots, st.probe_accepted),
            # its steps in which all drafted with nobody queued: the least request's expected
            # drafts they were planned at, and the drafts they gained the batch
            "whole": (st.whole_steps, st.whole_planned, st.whole_gained),
        },
        "_outputs": {tuple(p): list(r.output_ids) for p, r in zip(prompts, recs, strict=True)},
        **({"_resyncs": engine.resyncs} if isinstance(engine, ReferenceEngine) else {}),
    }


def run_hf(
    model,
    prompts: list[list[int]],
    concurrency: int,
    params: SamplingParams,
    pad_id: int,
    eos: list[int],
    lookup: bool,
) -> dict:
    """HF generate, ``concurrency`` prompts per call (left padding), greedy, to the engines'
    ``params``: ``max_new_tokens`` and ``ignore_eos`` (every reply that long)."""
    ignore_eos = params.ignore_eos
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        group = prompts[i : i + concurrency]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        kw = {"prompt_lookup_num_tokens": 10} if lookup else {}
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=params.max_new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
                eos_token_id=None if ignore_eos else eos,
                **kw,
            )
        for row in out[:, width:].tolist():
            if ignore_eos:
                tokens += len(row)
                continue
            n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            tokens += n - (1 if row[n - 1] in eos else 0)
    return {"tokens_per_s": tokens / (time.perf_counter() - t0), "output_tokens": tokens}


def run_llamacpp(peer: Any, prompts: list[list[int]], c: int, new: int) -> dict:
    """The llama.cpp peer over ``prompts``, ``c`` at a time (one batch each): tokens/s over all."""
    tokens, seconds = 0, 0.0
    for i in range(0, len(prompts), c):
        chunk = prompts[i : i + c]
        tps, _ = peer.run(chunk, new)
        tokens += len(chunk) * new
        seconds += len(chunk) * new / tps
    return {"tokens_per_s": tokens / seconds, "output_tokens": tokens}


def cell_config(policy: Policy, concurrency: int, suffix: str = "global") -> EngineConfig:
    """The engine settings of one concurrency (both studies). Suffix drafts draw on the
    history of one run only (a fresh engine): a repeat never drafts from the answers of the
    same prompts in an earlier one."""
    return EngineConfig(
        policy=policy,
        max_running_requests=concurrency,
        max_batch_tokens=16 * concurrency,
        suffix=suffix,
    )


def greedy_references(s: Setup, prompts: list[list[int]]) -> Refs:
    """The target's greedy continuation of each prompt (plain decoding, batch 16)."""
    engine = Engine(
        s.target,
        None,
        EngineConfig(policy="ar", max_running_requests=16),
        eos_token_ids=tuple(s.eos),
    )
    return run_engine(engine, prompts, s.params)["_outputs"]


def adapt(
    base: DFlashDrafter,
    target: TargetModel,
    train: list[Trajectory],
    evals: list[tuple[list[int], int]],
    loss: str,
    rounds: int,
    chunk: int,
    args: argparse.Namespace,
) -> tuple[DFlashDrafter, list[float]]:
    """``rounds`` online rounds (train on the next chunk, starting from the last version)."""
    drafter = copy.deepcopy(base).float()
    curve = [simulate_acceptance(drafter, target, evals, args.sim_anchors).accept_len]
    cfg = DistillConfig(loss=loss, epochs=args.epochs, anchors_per_seq=args.anchors)
    for r in range(rounds):
        part = train[r * chunk : (r + 1) * chunk]
        if not part:
            break
        drafter = fit(drafter, target, part, None, cfg, progress=False).drafter
        curve.append(simulate_acceptance(drafter, target, evals, args.sim_anchors).accept_len)
    return drafter, curve


# -- the paper's Table 1 ------------------------------------------------------------------------


def paper_domain(
    s: Setup,
    domain: str,
    all_prompts: list[list[int]],
    ar_ref: Refs,
    shipped: DFlashDrafter,
    curves: dict[str, list[float]],
) -> list[dict]:
    """One domain of Table 1: online adaptation, then every method at every concurrency."""
    args, target, eos = s.args, s.target, s.eos
    prompts = all_prompts[: args.prompts]
    # the domain's on-policy data: greedy trajectories of its train prompts
    train_prompts = [
        encode_prompt(s.tok, p.prompt, chat=True)
        for p in load_prompts(domain, "train", args.rounds * args.chunk)
    ]
    gen = Engine(
        target, None, EngineConfig(policy="ar", max_running_requests=16), eos_token_ids=tuple(eos)
    )
    train = [
        Trajectory(f"{domain}-{i}", domain, p, list(r.output_ids), "", r.finish_reason)
        for i, (p, r) in enumerate(
            zip(train_prompts, gen.generate(train_prompts, s.params), strict=True)
        )
    ]
    evals = [(p + ar_ref[tuple(p)], len(p)) for p in prompts]
    drafters = {"dflash": shipped}
    for name, loss in (("osd", "osd"), ("adaflash", "opd")):
        drafters[name], curves[f"{domain}/{name}"] = adapt(
            shipped, target, train, evals, loss, args.rounds, args.chunk, args
        )
        print(
            f"[{domain}] {name} adaptation curve (simulated τ): "
            f"{[round(x, 3) for x in curves[f'{domain}/{name}']]}",
            flush=True,
        )
    rows = []
    for c in args.concurrency:
        prompts = all_prompts[: max(args.prompts, c)]
        base = run_engine(
            Engine(target, None, cell_config("ar", c), eos_token_ids=tuple(eos)),
            prompts,
            s.params,
        )
        results = {"ar": base}
        results["hf"] = run_hf(s.hf, prompts, c, s.params, eos[0], eos, False)
        if c == 1:
            results["hf-pld"] = run_hf(s.hf, prompts, 1, s.params, eos[0], eos, True)
        for m in SPEC_METHODS:
            d = drafters["adaflash" if m == "oracle" else m]
            policy: Policy = "head" if m == "adaflash" else "fixed"
            kw = {"references": ar_ref} if m == "oracle" else {}
            cls = OracleLengthEngine if m == "oracle" else Engine
            results[m] = run_engine(
                cls(
                    target,
                    copy.deepcopy(d),
                    cell_config(policy, c),
                    eos_token_ids=tuple(eos),
                    **kw,
                ),
                prompts,
                s.params,
            )
        ar_outs = base["_outputs"]
        for m, r in results.items():
            outs = r.pop("_outputs", None)
            r.pop("_pricing", None)
            r.pop("_timing", None)
            resyncs = r.pop("_resyncs", None)  # the length oracle's answer key recomputed
            row = {
                "domain": domain,
                "concurrency": c,
                "method": m,
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()},
                "speedup": round(speedup(r["tokens_per_s"], base["tokens_per_s"]), 3),
            }
            if outs is not None:  # lossless check (bf16 may flip a near-tie now and then)
                row["identical_to_ar"] = sum(outs[k] == ar_outs[k] for k in ar_outs)
            if resyncs is not None:
                row["resyncs"] = resyncs
            rows.append(row)
            print(
                f"{domain:<6} C={c:<3} {m:<9} {row['tokens_per_s']:7.1f} tok/s "
                f"x{row['speedup']:.2f}  τ {row.get('accept_len', float('nan')):.2f}  "
                f"verify_len {row.get('verify_len', float('nan')):.2f}",
                flush=True,
            )
    return rows


# -- the policy study ---------------------------------------------------------------------------


def weak_drafter(shipped: DFlashDrafter, seed: int) -> DFlashDrafter:
    """The shipped drafter's config and draft vocabulary with freshly initialised weights (length
    head included), from a fixed seed: a drafter that is almost never right."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        weak = DFlashDrafter(shipped.cfg).float()
    if shipped.draft_vocab is not None:
        weak.set_draft_vocab(shipped.draft_vocab, shipped.draft_vocab_info)
    weak.head_trained = False
    return weak.eval()


def policy_plan(
    drafters: list[str],
    with_hf: bool = True,
    with_llama: bool = False,
    criteria_only: bool = False,
    capture_row: bool = False,
) -> list[Key]:
    """The methods of one cell in the order each repeat runs them; ``criteria_only``: the rows
    the criteria read alone (``cost`` with every drafter, ``head`` and ``oracle-len`` with the
    shipped one); ``capture_row``: ``ar-capture`` with the first drafter, right after ``ar``."""
    plan: list[Key] = [(None, "ar")] + ([(None, "hf")] if with_hf else [])
    plan += [(None, "llamacpp")] if with_llama else []
    plan += [(drafters[0], CAPTURE_METHOD)] if capture_row and drafters else []
    for d in drafters:
        methods = POLICY_METHODS if d == "shipped" or not criteria_only else ("cost", "cost-dflash")
        plan += [(d, m) for m in methods if not (d == "oracle" and m == "oracle-len")]
    return plan


def run_method(
    s: Setup,
    key: Key,
    prompts: list[list[int]],
    c: int,
    ar_ref: Refs,
    drafters: dict[str, DFlashDrafter],
) -> dict:
    """One run of one method of the policy study (a fresh engine)."""
    method = key[1]
    if method == "hf":
        return run_hf(s.hf, prompts, c, s.params, s.eos[0], s.eos, False)
    if method == "llamacpp":
        return run_llamacpp(s.llama, prompts, c, s.args.max_new_tokens)
    return run_engine(method_engine(s, key, c, ar_ref, drafters), prompts, s.params)


def method_engine(
    s: Setup, key: Key, c: int, ar_ref: Refs, drafters: dict[str, DFlashDrafter]
) -> Engine:
    """A fresh engine for one run of an engine method (its warm state carried over)."""
    name, method = key
    cfg = cell_config(ENGINE_POLICY[method], c, "off" if method in SUFFIX_OFF else "global")
    eos = tuple(s.eos)
    if name is None:
        return Engine(s.target, None, cfg, eos_token_ids=eos)
    d = drafters[name]
    if name == "oracle":
        engine: Engine = OracleDrafterEngine(s.target, d, cfg, eos_token_ids=eos, references=ar_ref)
    elif method == "oracle-len":
        engine = OracleLengthEngine(s.target, d, cfg, eos_token_ids=eos, references=ar_ref)
    else:
        engine = Engine(s.target, d, cfg, eos_token_ids=eos)
    if not s.args.cold:  # warm: what this method learned in its earlier runs at this C
        state = s.warm.setdefault((name, method, c), (engine.cost, engine._policy))
        engine.cost, engine._policy = state
    return engine


def policy_cell(
    s: Setup,
    prompts: list[list[int]],
    c: int,
    ar_ref: Refs,
    drafters: dict[str, DFlashDrafter],
) -> dict[Key, list[dict]]:
    """Every method of one (domain, C) cell, ``--repeats`` times (module docstring: in
    lockstep, or interleaved with ``--sequential``).

    The oracles' answer key is the cell's own ``ar`` output: in bf16 a batch-16 eager reference
    and a batch-1 compiled step can round a near-tie differently, and an oracle drafter that
    follows a continuation the target no longer produces stops being an oracle (the drift that
    remains, each oracle engine mends between steps: ``ReferenceEngine``)."""
    plan = policy_plan(
        list(drafters),
        with_hf=not s.args.no_hf,
        with_llama=s.llama is not None,
        criteria_only=s.args.criteria_only,
        capture_row=s.args.capture_row,
    )
    runs: dict[Key, list[dict]] = {key: [] for key in plan}
    if s.args.sequential:
        for rep in range(s.args.repeats):
            for key in rotated(plan, rep, s.args.repeats):
                run = run_method(s, key, prompts, c, ar_ref, drafters)
                runs[key].append(run)
                if key == (None, "ar"):  # the answer key as this C computes it (docstring)
                    ar_ref = {**ar_ref, **run["_outputs"]}
        return runs
    # lockstep: the engine methods side by side (``run_lockstep``), the peers in runs of their
    # own before or after them; the answer key from an untimed ``ar`` run first
    ar_ref = {**ar_ref, **run_method(s, (None, "ar"), prompts, c, ar_ref, drafters)["_outputs"]}
    peers = [key for key in plan if key[1] in ("hf", "llamacpp")]
    together = [key for key in plan if key not in peers]
    blocks: list[Key | None] = [None, *peers]  # None: the lockstep block
    for rep in range(s.args.repeats):
        for block in rotated(blocks, rep, s.args.repeats):
            if block is not None:
                runs[block].append(run_method(s, block, prompts, c, ar_ref, drafters))
                continue
            engines = {key: method_engine(s, key, c, ar_ref, drafters) for key in together}
            for key, run in run_lockstep(engines, prompts, s.params).items():
                runs[key].append(run)
    return runs


def rotated(plan: list, rep: int, repeats: int) -> list:
    """The order of repeat ``rep``: the plan rotated by an even share per repeat, so that no
    method always runs first, or always right after the same one (a slow spell of the machine
    then lands on different methods; the first repeat keeps ``ar`` first for the oracles)."""
    shift = rep * len(plan) // max(repeats, 1)
    return plan[shift:] + plan[:shift]


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def policy_rows(domain: str, c: int, runs: dict[Key, list[dict]]) -> list[dict]:
    """One row per (drafter, method) of a cell: median/min/max over the repeats.

    ``speedup`` = median ÷ median ``ar``; ``speedup_min`` = min ÷ max ``ar`` (worst pairing);
    ``speedup_max`` = max ÷ min ``ar`` (best pairing); ``paired`` = median [min, max] over
    repeats of run i ÷ ``ar`` run i. τ and verify length: medians."""
    ar_reps = runs[(None, "ar")]
    ar_med, ar_min, ar_max = spread([r["tokens_per_s"] for r in ar_reps])
    ar_outs = ar_reps[0].get("_outputs")
    rows = []
    for (drafter, method), reps in runs.items():
        med, lo, hi = spread([r["tokens_per_s"] for r in reps])
        seconds = sum(r["output_tokens"] / r["tokens_per_s"] for r in reps)  # the runs' walls
        row: dict[str, Any] = {
            "study": "policies",
            "domain": domain,
            "concurrency": c,
            "drafter": drafter,
            "method": method,
            "repeats": len(reps),
            "tokens_per_s": round(med, 4),
            "tokens_per_s_min": round(lo, 4),
            "tokens_per_s_max": round(hi, 4),
            "speedup": round(speedup(med, ar_med), 3),
            "speedup_min": round(speedup(lo, ar_max), 3),
            "speedup_max": round(speedup(hi, ar_min), 3),
            **paired(reps, ar_reps),
            "output_tokens": reps[0]["output_tokens"],
            "seconds": round(seconds, 3),
        }
        timing = [r["_timing"] for r in reps if "_timing" in r]
        if timing:  # Σ over the repeats, seconds
            draft, verify = sum(t["draft"] for t in timing), sum(t["verify"] for t in timing)
            row["steps"] = sum(t["steps"] for t in timing)
            row["draft_s"], row["verify_s"] = round(draft, 3), round(verify, 3)
            row["outside_s"] = round(seconds - draft - verify, 3)
        pricing = [r["_pricing"] for r in reps if "_pricing" in r]
        if method == "cost" and pricing:  # how well it priced its steps: Σ predicted ÷ Σ measured
            for kind in ("drafting", "plain"):
                pred = sum(p[kind][0] for p in pricing)
                meas = sum(p[kind][1] for p in pricing)
                if meas > 0:
                    row[f"{kind}_steps_s"] = round(meas, 3)
                    row[f"{kind}_predicted_over_measured"] = round(pred / meas, 3)
            expected = sum(p["tokens"][0] for p in pricing if "tokens" in p)
            realised = sum(p["tokens"][1] for p in pricing if "tokens" in p)
            if realised > 0:
                row["drafting_tokens_expected_over_realised"] = round(expected / realised, 3)
            whole = [p["whole"] for p in pricing if "whole" in p]
            row["whole_steps"] = sum(n for n, _, _ in whole)
            planned = sum(p for _, p, _ in whole)
            if planned > 0:
                row["whole_gained_over_planned"] = round(sum(g for *_, g in whole) / planned, 3)
            probes = [p["probes"] for p in pricing if "probes" in p]
            row["probes"] = sum(n for n, _, _ in probes)
            slots = sum(s for _, s, _ in probes)
            if slots:
                row["probe_hit_rate"] = round(sum(a for *_, a in probes) / slots, 4)
        if drafter is not None:
            row["accept_len"] = round(statistics.median(r["accept_len"] for r in reps), 4)
            row["verify_len"] = round(statistics.median(r["verify_len"] for r in reps), 4)
        outs = reps[0].get("_outputs")
        if outs is not None and ar_outs is not None:  # lossless check (bf16 near-ties aside)
            row["identical_to_ar"] = sum(outs[k] == ar_outs[k] for k in ar_outs)
        if "_resyncs" in reps[0]:  # its answer key recomputed, Σ over the repeats (ReferenceEngine)
            row["resyncs"] = sum(r["_resyncs"] for r in reps)
        rows.append(row)
    return rows


def paired(reps: list[dict], ar_reps: list[dict]) -> dict[str, float]:
    """Per repeat: this run's tokens/s ÷ the same repeat's ``ar`` run; median, min, max."""
    ratios = [
        speedup(r["tokens_per_s"], a["tokens_per_s"]) for r, a in zip(reps, ar_reps, strict=True)
    ]
    med, lo, hi = spread(ratios)
    return {"paired": round(med, 3), "paired_min": round(lo, 3), "paired_max": round(hi, 3)}


def print_policy_row(row: dict) -> None:
    print(
        f"{row['domain']:<6} C={row['concurrency']:<3} {row['drafter'] or '-':<8} "
        f"{row['method']:<10} {row['tokens_per_s']:7.1f} tok/s "
        f"[{row['tokens_per_s_min']:.1f}–{row['tokens_per_s_max']:.1f}] x{row['speedup']:.2f} "
        f"[{row['speedup_min']:.2f}–{row['speedup_max']:.2f}] "
        f"paired x{row.get('paired', float('nan')):.2f}  "
        f"τ {row.get('accept_len', float('nan')):.2f}  "
        f"verify_len {row.get('verify_len', float('nan')):.2f}",
        flush=True,
    )


def policy_domain(
    s: Setup, domain: str, all_prompts: list[list[int]], ar_ref: Refs, drafters: dict
) -> list[dict]:
    rows = []
    for c in s.args.concurrency:
        prompts = all_prompts[: max(s.args.prompts, c)]
        for row in policy_rows(domain, c, policy_cell(s, prompts, c, ar_ref, drafters)):
            print_policy_row(row)
            rows.append(row)
    return rows


def warm_up(s: Setup, prompts: list[list[int]], drafters: dict[str, DFlashDrafter]) -> None:
    """One short untimed pass per engine kind: one-time kernel set-up stays out of the cells."""
    params = SamplingParams(max_new_tokens=8)
    eos = tuple(s.eos)
    Engine(s.target, None, cell_config("ar", 1), eos_token_ids=eos).generate(prompts[:1], params)
    d = next(iter(drafters.values()))
    for policy in ("head", "cost"):
        Engine(s.target, d, cell_config(policy, 1), eos_token_ids=eos).generate(prompts[:1], params)
    run_hf(s.hf, prompts[:1], 1, params, s.eos[0], s.eos, False)


# -- criteria -----------------------------------------------------------------------------------


def policy_index(rows: list[dict]) -> dict[tuple[str | None, str, str, int], dict]:
    """(drafter, method, domain, C) → row, over the policy study's rows only."""
    return {
        (r["drafter"], r["method"], r["domain"], r["concurrency"]): r
        for r in rows
        if r.get("study") == "policies"
    }


def verdict(cells: list[dict]) -> bool | None:
    """PASS when every checked cell passes; None when nothing could be checked."""
    return all(c["pass"] for c in cells) if cells else None


def criterion_weak(rows: list[dict]) -> dict:
    """(a) weak drafter: cost's paired speedup (median over repeats of cost ÷ the same repeat's
    ar; the unpaired median ratio where a row has none) ≥ WEAK_FLOOR in every (domain, C) cell."""
    idx = policy_index(rows)
    cells = [
        {
            "domain": d,
            "concurrency": c,
            "speedup": r["speedup"],
            "paired": r.get("paired", r["speedup"]),
        }
        for (drafter, m, d, c), r in idx.items()
        if drafter == "weak" and m == "cost"
    ]
    for cell in cells:
        cell["pass"] = cell["paired"] >= WEAK_FLOOR
    return {
        "rule": f"weak drafter: cost ≥ {WEAK_FLOOR}× ar in every (domain, C) cell (paired: median "
        "over repeats of cost ÷ the same repeat's ar)",
        "pass": verdict(cells),
        "cells": cells,
    }


def criterion_shipped(rows: list[dict]) -> dict:
    """(b) shipped drafter: cost ≥ max(ar, head) in every cell within noise — cost's best repeat
    (max tokens/s) reaches the median tokens/s of ar and of head."""
    idx = policy_index(rows)
    cells, repeats = [], []
    for (drafter, m, d, c), r in idx.items():
        if drafter != "shipped" or m != "cost":
            continue
        repeats.append(r.get("repeats", 1))
        rivals = {
            name: idx[key]["tokens_per_s"]
            for name, key in (("ar", (None, "ar", d, c)), ("head", ("shipped", "head", d, c)))
            if key in idx
        }
        best = max(rivals.values(), default=0.0)
        cells.append(
            {
                "domain": d,
                "concurrency": c,
                "cost_median": r["tokens_per_s"],
                "cost_max": r["tokens_per_s_max"],
                **{f"{name}_median": v for name, v in rivals.items()},
                "pass": r["tokens_per_s_max"] >= best,
            }
        )
    return {
        "rule": "shipped drafter: cost ≥ max(ar, head) in every (domain, C) cell within noise, "
        "i.e. cost's max tokens/s over the repeats ≥ the median tokens/s of ar and of head",
        "pass": verdict(cells),
        "cells": cells,
        # how often the rule fails a cell where cost runs exactly as ar does (``null_fail_rate``)
        "null_fail_rate": round(null_fail_rate(min(repeats, default=0)), 4),
    }


def null_fail_rate(repeats: int) -> float:
    """(b)'s rule held against itself: the chance that it fails a cell where ``cost`` is no
    different from ``ar`` — both cells' ``repeats`` runs drawn from one distribution — i.e.
    that cost's best run falls below ar's median. All C(2n, n) orders of the 2n runs are
    equally likely, so it is exact for an odd n whatever the distribution (3 repeats: 0.20);
    for an even n, ar's median lies between its two middle runs and this counts only the
    orders below the lower one (a lower bound)."""
    n = repeats
    if n < 1:
        return 0.0
    orders = list(itertools.combinations(range(2 * n), n))  # the positions of cost's runs
    fails = 0
    for mine in orders:
        others = [i for i in range(2 * n) if i not in mine]
        fails += max(mine) < others[(n - 1) // 2]
    return fails / len(orders)


def criterion_oracle(rows: list[dict]) -> dict:
    """(c) shipped drafter: at each C, cost's speedup averaged over domains ≥ ORACLE_SHARE ×
    oracle-len's (speedups share the cell's ar, so this compares throughputs domain by domain)."""
    idx = policy_index(rows)
    cells = []
    for c in sorted({k[3] for k in idx}):
        domains = [
            d
            for (drafter, m, d, cc) in idx
            if (drafter, m, cc) == ("shipped", "cost", c) and ("shipped", "oracle-len", d, c) in idx
        ]
        if not domains:
            continue
        cost = sum(idx[("shipped", "cost", d, c)]["speedup"] for d in domains) / len(domains)
        oracle = sum(idx[("shipped", "oracle-len", d, c)]["speedup"] for d in domains) / len(
            domains
        )
        ratio = cost / oracle if oracle else 0.0
        cells.append(
            {
                "concurrency": c,
                "domains": domains,
                "cost_speedup": round(cost, 3),
                "oracle_len_speedup": round(oracle, 3),
                "ratio": round(ratio, 3),
                "pass": ratio >= ORACLE_SHARE,
            }
        )
    return {
        "rule": f"shipped drafter: cost ≥ {ORACLE_SHARE:.0%} of oracle-len at each C "
        "(median speedups averaged over domains)",
        "pass": verdict(cells),
        "cells": cells,
    }


def criteria(rows: list[dict]) -> dict[str, dict]:
    return {"a": criterion_weak(rows), "b": criterion_shipped(rows), "c": criterion_oracle(rows)}


# -- output -------------------------------------------------------------------------------------


def engine_knobs(block_size: int) -> dict:
    """The verify-width settings a run used (for ``args``: the run is reproducible from them)."""
    cfg = EngineConfig(policy="cost").as_dict()
    cost = policies.make_policy("cost", block_size)
    assert isinstance(cost, policies.CostPolicy)
    return {
        "max_running_requests": "C",
        "max_batch_tokens": "16 × C",
        **{k: cfg[k] for k in ("gamma", "ema_beta", "max_prefill_tokens", "max_context")},
        "block_size": block_size,
        "cost_policy": {
            "probe_every": cost.probe_every,
            "probe_requests": policies.PROBE_REQUESTS,
            "probe_share": policies.PROBE_SHARE,
            "probe_start_s": policies.PROBE_START_S,
            "start_profile": policies.START,
            "decay": policies.DECAY,
            "max_probe_gap": policies.MAX_PROBE_GAP,
            "prior_weight": policies.PRIOR_WEIGHT,
        },
    }


def paper_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("study", "paper") == "paper"]


def markdown(result: dict) -> str:
    parts = []
    if paper_rows(result["rows"]):
        parts.append(paper_markdown(result))
    if policy_index(result["rows"]):
        parts.append(policy_markdown(result))
    return "\n".join(parts)


def paper_markdown(result: dict) -> str:
    rows = paper_rows(result["rows"])
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["concurrency"], r["domain"]): r for r in rows}
    lines = [
        f"Speedup over `ar` / τ (verify length) — {result['date']}, "
        f"{result['machine']['platform']}, torch {result['machine']['torch']}, "
        f"{result['args']['prompts']} prompts (C prompts where C is larger) × "
        f"{result['args']['max_new_tokens']} tokens per domain, greedy, "
        f"{result['args']['dtype']}, {result['machine']['torch_threads']} torch thread(s). "
        + result["args"].get("note", ""),
        "",
        "| method | C | " + " | ".join(domains) + " | avg |",
        "|---|---|" + "---|" * (len(domains) + 1),
    ]
    for m in methods:
        for c in concs:
            cells, sp, taus = [], [], []
            for d in domains:
                r = cell.get((m, c, d))
                if r is None:
                    cells.append("—")
                    continue
                sp.append(r["speedup"])
                if "accept_len" in r:
                    taus.append(r["accept_len"])
                    cells.append(
                        f"{r['speedup']:.2f}× / {r['accept_len']:.2f} ({r['verify_len']:.1f})"
                    )
                else:
                    cells.append(f"{r['speedup']:.2f}×")
            if not sp:
                continue
            avg = f"{sum(sp) / len(sp):.2f}×" + (f" / {sum(taus) / len(taus):.2f}" if taus else "")
            lines.append(f"| {m} | {c} | " + " | ".join(cells) + f" | {avg} |")
    lines += [
        "",
        "Cells: speedup / τ (average verify length). τ = tokens per round, bonus included.",
    ]
    return "\n".join(lines) + "\n"


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def policy_summary(idx: dict, drafter: str, concs: list[int], domains: list[str]) -> list[str]:
    """Rows = method (ar, hf and llamacpp for reference), columns = C, cells = domain-averaged
    speedup."""
    methods = [("ar", None), ("hf", None), ("llamacpp", None)]
    methods += [(m, drafter) for m in ROW_METHODS]
    lines = [
        "| method | " + " | ".join(f"C={c}" for c in concs) + " |",
        "|---|" + "---|" * len(concs),
    ]
    for m, d in methods:
        cells = []
        for c in concs:
            rs = [idx[(d, m, dom, c)] for dom in domains if (d, m, dom, c) in idx]
            if not rs:
                cells.append("—")
                continue
            cell = f"{mean([r['speedup'] for r in rs]):.2f}×"
            if "accept_len" in rs[0]:
                tau, width = (
                    mean([r["accept_len"] for r in rs]),
                    mean([r["verify_len"] for r in rs]),
                )
                cell += f" / {tau:.2f} ({width:.1f})"
            cells.append(cell)
        if any(x != "—" for x in cells):
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def policy_detail(
    idx: dict, drafter: str | None, concs: list[int], domains: list[str]
) -> list[str]:
    """Rows = method × domain, columns = C; cells = median speedup [worst–best], paired speedup
    / τ (width), or for ar/hf/llamacpp (``drafter`` None) median tokens/s [min–max]."""
    methods = ("ar", "hf", "llamacpp") if drafter is None else ROW_METHODS
    lines = [
        "| method | domain | " + " | ".join(f"C={c}" for c in concs) + " |",
        "|---|---|" + "---|" * len(concs),
    ]
    for m in methods:
        for dom in domains:
            cells = []
            for c in concs:
                r = idx.get((drafter, m, dom, c))
                if r is None:
                    cells.append("—")
                elif drafter is None:
                    cells.append(
                        f"{r['tokens_per_s']:.1f} [{r['tokens_per_s_min']:.1f}–"
                        f"{r['tokens_per_s_max']:.1f}]"
                    )
                else:
                    pair = (
                        f" paired {r['paired']:.2f}× [{r['paired_min']:.2f}–{r['paired_max']:.2f}]"
                        if "paired" in r
                        else ""
                    )
                    cells.append(
                        f"{r['speedup']:.2f}× [{r['speedup_min']:.2f}–{r['speedup_max']:.2f}]"
                        f"{pair} / {r['accept_len']:.2f} ({r['verify_len']:.1f})"
                    )
            if any(x != "—" for x in cells):
                lines.append(f"| {m} | {dom} | " + " | ".join(cells) + " |")
    return lines


def criteria_lines(crit: dict[str, dict]) -> list[str]:
    lines = []
    for name, cr in crit.items():
        status = {True: "PASS", False: "FAIL", None: "n/a (no rows)"}[cr["pass"]]
        failed = [c for c in cr["cells"] if not c["pass"]]
        where = ", ".join(
            f"{c['domain']} C={c['concurrency']}" if "domain" in c else f"C={c['concurrency']}"
            for c in failed
        )
        detail = f" — {len(failed)}/{len(cr['cells'])} failing: {where}" if failed else ""
        lines.append(f"- ({name}) {cr['rule']}: **{status}**{detail}")
        if name == "a" and cr["cells"]:
            worst = min(cr["cells"], key=lambda c: c["paired"])
            lines.append(
                f"  - worst cell: {worst['domain']} C={worst['concurrency']} paired "
                f"{worst['paired']:.2f}× (unpaired median ratio {worst['speedup']:.2f}×)"
            )
        if name == "b":
            if "null_fail_rate" in cr and cr["cells"]:
                rate, cells = cr["null_fail_rate"], len(cr["cells"])
                lines.append(
                    f"  - the rule's own noise: where cost ran exactly as ar does it would fail a "
                    f"cell with probability {rate:.2f} ({rate * cells:.1f} of {cells} cells "
                    f"expected; all pass {(1 - rate) ** cells:.0%} of the time)"
                )
            for c in failed:
                rivals = ", ".join(
                    f"{k[:-7]} {v:.1f}"
                    for k, v in c.items()
                    if k.endswith("_median") and k != "cost_median"
                )
                lines.append(
                    f"  - {c['domain']} C={c['concurrency']}: cost {c['cost_median']:.1f} "
                    f"(max {c['cost_max']:.1f}) tok/s vs {rivals}"
                )
        if name == "c":
            lines += [
                f"  - C={c['concurrency']}: cost {c['cost_speedup']:.2f}× vs oracle-len "
                f"{c['oracle_len_speedup']:.2f}× → {c['ratio']:.0%}"
                for c in cr["cells"]
            ]
    return lines


def policy_markdown(result: dict) -> str:
    idx = policy_index(result["rows"])
    domains = list(dict.fromkeys(k[2] for k in idx))
    concs = sorted({k[3] for k in idx})
    drafters = [d for d in POLICY_DRAFTERS if any(k[0] == d for k in idx)]
    a, m = result["args"], result["machine"]
    lines = [
        "## Policy study: verify width",
        "",
        f"{result['date']}, {m['platform']}, torch {m['torch']}, {a['prompts']} prompts "
        f"(C prompts where C is larger) × {a['max_new_tokens']} tokens per domain"
        + (" (EOS ignored)" if a.get("ignore_eos") else "")
        + ", greedy, "
        f"{a['dtype']}, {m['torch_threads']} torch thread(s), {a['repeats']} repeats per cell "
        + (
            "(runs interleaved)"
            if a.get("sequential", True)
            else "(engine methods side by side, a step each in turn)"
        )
        + f", domains {', '.join(domains)}. "
        + a.get("note", ""),
        "",
        "Cells: median speedup over `ar` averaged over domains / τ (average verify length).",
    ]
    for d in drafters:
        lines += ["", f"### drafter `{d}`", "", *policy_summary(idx, d, concs, domains)]
    lines += [
        "",
        "### per cell",
        "",
        "`ar`, `hf` and `llamacpp`: median tokens/s [min–max] over the repeats.",
        "",
        *policy_detail(idx, None, concs, domains),
    ]
    for d in drafters:
        lines += [
            "",
            f"drafter `{d}`: median speedup [worst–best pairing with `ar`'s repeats], paired "
            "speedup (median [min–max] over repeats of run ÷ that repeat's `ar`) / τ "
            "(average verify length).",
            "",
            *policy_detail(idx, d, concs, domains),
        ]
    lines += ["", "### criteria", "", *criteria_lines(result["criteria"])]
    return "\n".join(lines) + "\n"


def charts(result: dict, out: Path) -> list[str]:
    """PNG charts of the studies that ran; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    names = []
    if paper_rows(result["rows"]):
        names += paper_charts(result, out)
    if policy_index(result["rows"]):
        names.append(policy_chart(result, out))
    return names


def paper_charts(result: dict, out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    rows = paper_rows(result["rows"])
    methods = list(dict.fromkeys(r["method"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for m in methods:
        ys = []
        for c in concs:
            vals = [r["speedup"] for r in rows if r["method"] == m and r["concurrency"] == c]
            ys.append(sum(vals) / len(vals) if vals else float("nan"))
        ax.plot(concs, ys, marker="o", label=m)
    ax.axhline(1.0, color="gray", ls="--")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("speedup over plain decoding (avg over domains)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in result["adaptation_curves"].items():
        ax.plot(range(len(curve)), curve, marker="o", label=name)
    ax.set_xlabel("online adaptation round")
    ax.set_ylabel("simulated τ on held-out prompts (full block)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "adaptation.png", dpi=110)
    return ["speedup.png", "adaptation.png"]


def policy_chart(result: dict, out: Path) -> str:
    """One panel per drafter: domain-averaged speedup per method against concurrency, with the
    domain-averaged worst/best pairing as the error bar."""
    import matplotlib.pyplot as plt

    idx = policy_index(result["rows"])
    concs = sorted({k[3] for k in idx})
    drafters = [d for d in POLICY_DRAFTERS if any(k[0] == d for k in idx)]
    fig, axes = plt.subplots(1, len(drafters), figsize=(4.2 * len(drafters), 4), squeeze=False)
    for ax, d in zip(axes[0], drafters, strict=True):
        for m, dr in [("hf", None)] + [(m, d) for m in POLICY_METHODS]:
            pts = []
            for c in concs:
                rs = [r for k, r in idx.items() if k[:2] == (dr, m) and k[3] == c]
                if rs:
                    med = mean([r["speedup"] for r in rs])
                    worst = mean([r["speedup_min"] for r in rs])
                    best = mean([r["speedup_max"] for r in rs])
                    pts.append((c, med, med - worst, best - med))
            if pts:
                xs, ys, below, above = zip(*pts, strict=True)
                ax.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, label=m)
        ax.axhline(1.0, color="gray", ls="--")
        ax.set_title(f"drafter: {d}")
        ax.set_xlabel("concurrency")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("speedup over ar (avg over domains)")
    fig.tight_layout()
    fig.savefig(out / "policies.png", dpi=110)
    return "policies.png"


# -- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run (< 10 min)")
    ap.add_argument(
        "--study",
        choices=STUDIES,
        default="paper",
        help="paper: Table 1 (online adaptation); policies: verify-width policies; both",
    )
    ap.add_argument(
        "--drafter", default=f"assets/drafters/{DEFAULT_DRAFTER}", help="relative to the repo"
    )
    ap.add_argument("--target", default=None)
    ap.add_argument("--domains", nargs="+", default=["math", "code", "chat", "blend"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument(
        "--prompts",
        type=int,
        default=16,
        help="eval prompts per domain (at concurrency C > this, the first C prompts)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="online adaptation rounds")
    ap.add_argument("--chunk", type=int, default=64, help="train trajectories per round")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--sim-anchors", type=int, default=16)
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="policy study: runs per cell and method (default 3, 2 with --quick)",
    )
    ap.add_argument("--seed", type=int, default=0, help="policy study: the weak drafter's seed")
    ap.add_argument(
        "--drafters",
        nargs="+",
        choices=POLICY_DRAFTERS,
        default=list(POLICY_DRAFTERS),
        help="policy study: the drafters to run (default all three; a subset for a probe)",
    )
    ap.add_argument(
        "--criteria-only",
        action="store_true",
        help="policy study: only the rows the criteria read (cost with every drafter; head and "
        "oracle-len with the shipped one): under half the time, the slow rows left out",
    )
    ap.add_argument(
        "--capture-row",
        action="store_true",
        help="policy study: add ar-capture (plain decoding with the first drafter attached: "
        "what keeping its context costs, apart from the cost policy)",
    )
    ap.add_argument(
        "--no-hf",
        action="store_true",
        help="policy study: leave out HF generate (bench/peers.py has it)",
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every reply --max-new-tokens long: methods whose bf16 graphs round a near-tie "
        "differently then still do the same work (module docstring)",
    )
    ap.add_argument(
        "--gguf",
        default=None,
        help="policy study: a llama.cpp GGUF of the target (BF16) for a peer row (the bench extra)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--no-compile", action="store_true", help="policy study: eager one-request steps"
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="policy study: each method's run on its own, one after another (default: the "
        "engine methods of a repeat side by side, a step each in turn; run_lockstep)",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="policy study: no cost model or acceptance profile carried between runs",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--note", default="", help="free text stored with the results")
    ap.add_argument(
        "--out",
        default=None,
        help="default docs/results/compare (docs/results/compare-policies for --study policies)",
    )
    args = ap.parse_args()
    if args.out is None:
        args.out = "docs/results/compare" + ("-policies" if args.study == "policies" else "")
    if args.quick:
        args.domains, args.concurrency = ["chat", "math"], [1, 4]
        args.prompts, args.max_new_tokens, args.rounds, args.chunk = 4, 48, 1, 8
        args.epochs, args.out = 1, args.out + "-quick"
        if args.study == "policies":
            args.max_new_tokens = 24
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.gguf and not Path(args.gguf).is_file():
        ap.error(f"--gguf {args.gguf}: no such file (scripts/peer_models.sh makes it)")
    if args.repeats < 1:
        ap.error("--repeats must be ≥ 1")
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.time()
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.dtype)
    tok = Tokenizer.from_folder(target_dir)
    eos = sorted(set(target.cfg.eos_token_ids) | set(tok.eos_token_ids))
    drafter_dir = Path(args.drafter)
    shipped = load_drafter(drafter_dir if drafter_dir.exists() else REPO / drafter_dir, "float32")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, args.dtype))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    s = Setup(target, tok, hf, eos, params, args)
    args.engine = engine_knobs(shipped.cfg.block_size)
    study_paper, study_policies = (
        args.study in ("paper", "both"),
        args.study in ("policies", "both"),
    )
    if args.gguf and study_policies:
        from peers import LlamaCppPeer  # bench/peers.py: bench/ is on sys.path as a script

        s.llama = LlamaCppPeer(Path(args.gguf), torch.get_num_threads(), max(args.concurrency))
    served = copy.deepcopy(shipped).to(getattr(torch, args.dtype)).eval()  # as serve runs it
    weak = weak_drafter(shipped, args.seed).to(served.dtype)
    drafters = {
        name: d
        for name, d in (("shipped", served), ("weak", weak), ("oracle", served))
        if name in args.drafters
    }
    compile_s = (  # what `serve` compiles in the background, here before any cell
        compile_now(
            target,
            [(), tuple(served.cfg.target_layer_ids)],
            batch_sizes(max(args.concurrency)),
            served,
        )
        if study_policies and not args.no_compile
        else {}
    )
    rows: list[dict] = []
    curves: dict[str, list[float]] = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "results.partial.json"
    for i, domain in enumerate(args.domains):
        all_prompts = [
            encode_prompt(tok, p.prompt, chat=True)
            for p in load_prompts(domain, "eval", max([args.prompts, *args.concurrency]))
        ]
        ar_ref = greedy_references(s, all_prompts)
        if study_paper:
            rows += paper_domain(s, domain, all_prompts, ar_ref, shipped, curves)
        if study_policies:
            if i == 0:
                warm_up(s, all_prompts, drafters)
            rows += policy_domain(s, domain, all_prompts, ar_ref, drafters)
        # what is done so far, should the run be stopped (removed once results.json is written)
        partial.write_text(json.dumps({"args": vars(args), "rows": rows}, default=str) + "\n")
    result = {
        "benchmark": "bench/compare.py",
        "args": {
            **vars(args),
            "drafter": repo_relative(args.drafter),
            "gguf": args.gguf and Path(args.gguf).name,  # a file of the user's cache
        },
        "note": args.note,
        "rows": rows,
        "adaptation_curves": curves,
        "compile_s": compile_s,
        "compiled_route": compiled_route(target),
        "minutes": round((time.time() - t_start) / 60, 1),
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_info(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if study_policies:
        result["criteria"] = criteria(rows)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(markdown(result))
    partial.unlink(missing_ok=True)
    pngs = charts(result, out)
    print(f"wrote {out}/results.json, table.md, {', '.join(pngs)} ({result['minutes']} min)")


if __name__ == "__main__":
    main()
