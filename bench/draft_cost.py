"""What a drafter pass costs against a decode step, served, and what that does to speedup.

For each drafter *variant* (the shipped weights as they are, the same weights drafting from a
smaller draft vocabulary — its most frequent ids, the vocabulary being rank-ordered — or the
pass run eagerly) and each request count, engines serve the same eval prompts side by side, a
step each in turn (a slow spell of a shared machine lands on all alike): plain decoding
(``ar``: the compiled decode step), ``fixed`` (every request drafts and verifies the whole
block) and ``cost`` (the default policy). Every engine runs the compiled steps ``serve`` runs,
built before anything is timed.

Per row: ``draft_ms`` the median drafter pass of ``fixed``'s steps (its catch-up of new context
included), ``decode_ms`` the median step of ``ar``, ``ratio`` = draft_ms / decode_ms;
``verify_ms`` ``fixed``'s median target pass; ``tau`` its served acceptance length and
``replay_tau`` the training-side replay on ``ar``'s replies (every anchor, whole block);
``predicted_speedup`` = τ · decode / (verify + draft) — what ``fixed`` should gain — and
``fixed_speedup`` / ``cost_speedup`` the measured tokens/s over ``ar``'s.

    python bench/draft_cost.py --out docs/results/engine/draft_cost.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from adaflash.cli import default_drafter, encode_prompt
from adaflash.config import EngineConfig, SamplingParams
from adaflash.distill import simulate_acceptance
from adaflash.engine.engine import Engine
from adaflash.hardware import cpu_info, machine
from adaflash.metrics import speedup
from adaflash.models import draft_graph
from adaflash.models.decode_graph import compile_now
from adaflash.models.drafter import DFlashDrafter, load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.paths import repo_relative
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts


@dataclass
class Arm:
    """One engine of a lockstep run and the per-step figures it collected."""

    engine: Engine
    step_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)  # steps with a drafter pass
    verify_ms: list[float] = field(default_factory=list)  # … and their target pass
    spent: float = 0.0
    outputs: dict[int, list[int]] = field(default_factory=dict)


def variant(shipped: DFlashDrafter, name: str) -> tuple[DFlashDrafter, bool]:
    """(drafter, compiled pass) of a variant: ``shipped``, ``eager``, or ``+``-joined changes
    of the shipped weights: ``vocabN`` (its N most frequent draft ids) and ``layersN`` (its
    first N layers: what such a pass costs; its τ is not a trained N-layer drafter's)."""
    if name in ("shipped", "eager"):
        return shipped, name == "shipped"
    d = copy.deepcopy(shipped)
    for change in name.split("+"):
        if change.startswith("vocab"):
            size = int(change.removeprefix("vocab"))
            assert shipped.draft_vocab is not None and size <= shipped.draft_vocab.numel()
            d.set_draft_vocab(shipped.draft_vocab[:size], {"truncated_from": d.draft_vocab_size})
        elif change.startswith("layers"):
            n = int(change.removeprefix("layers"))
            d.layers = d.layers[:n]
            d.cfg = replace(d.cfg, num_layers=n)
        else:
            raise ValueError(f"unknown variant {name!r}: shipped, eager, vocabN, layersN")
    return d, True


def make_engine(
    target: TargetModel, drafter: DFlashDrafter | None, policy: str, requests: int, compiled: bool
) -> Engine:
    cfg = EngineConfig(policy=policy, max_running_requests=requests, compile=True)
    engine = Engine(target, drafter, cfg, eos_token_ids=target.cfg.eos_token_ids)
    if engine.drafting is not None and not compiled:
        engine.drafting.graph = None
    return engine


def lockstep(arms: dict[str, Arm], prompts: list[list[int]], params: SamplingParams) -> None:
    """Every arm serves ``prompts``, one step each in turn, in a new seeded order each turn."""
    for arm in arms.values():
        for i, p in enumerate(prompts):
            arm.engine.add_request(
                p,
                params,
                request_id=str(i),
                on_finish=lambda rec, a=arm: a.outputs.__setitem__(
                    int(rec.request_id), list(rec.output_ids)
                ),
            )
    order, live = random.Random(0), list(arms)
    while live:
        for key in order.sample(live, len(live)):
            arm, st = arms[key], arms[key].engine.stats
            d0, v0 = st.draft_s, st.verify_s
            t0 = time.perf_counter()
            stepped = arm.engine.step()
            dt = time.perf_counter() - t0
            arm.spent += dt
            arm.step_ms.append(1e3 * dt)
            if st.draft_s - d0 > 0 and arm.engine.drafting is not None:
                arm.draft_ms.append(1e3 * (st.draft_s - d0))
                arm.verify_ms.append(1e3 * (st.verify_s - v0))
            if len(arm.outputs) == len(prompts) or not (stepped or arm.engine.has_work):
                live.remove(key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--drafter", default=str(default_drafter()))
    ap.add_argument("--variants", nargs="+", default=["shipped", "eager", "vocab8192", "vocab4096"])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--domains", nargs="+", default=["chat", "code"])
    ap.add_argument("--prompts", type=int, default=8, help="eval prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default="docs/results/engine/draft_cost.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target_dir = resolve_target(None)
    target = load_target(target_dir, "bfloat16")
    tok = Tokenizer.from_folder(target_dir)
    shipped = load_drafter(args.drafter, "bfloat16")
    drafters = {name: variant(shipped, name) for name in args.variants}
    capture = tuple(shipped.cfg.target_layer_ids)
    batches = tuple(r for r in args.requests if r > 1)
    t0 = time.perf_counter()
    built = compile_now(target, [(), capture], batches, shipped)
    for d, compiled in drafters.values():
        if compiled:
            built |= draft_graph.compile_now(d, torch.bfloat16)
    print(f"compiled in {time.perf_counter() - t0:.0f} s: {built}", flush=True)
    prompts = [
        encode_prompt(tok, p.prompt, chat=True)
        for domain in args.domains
        for p in load_prompts(domain, "eval", args.prompts)
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for requests in args.requests:
        arms = {"ar": Arm(make_engine(target, None, "ar", requests, True))}
        for name, (d, compiled) in drafters.items():
            for policy in ("fixed", "cost"):
                arms[f"{name}/{policy}"] = Arm(make_engine(target, d, policy, requests, compiled))
        lockstep(arms, prompts, params)
        ar = arms["ar"]
        decode_ms = statistics.median(ar.step_ms)
        ar_tok_s = sum(len(o) for o in ar.outputs.values()) / ar.spent
        replies = [(list(p) + ar.outputs[i], len(p)) for i, p in enumerate(prompts)]
        for name, (d, _) in drafters.items():
            fixed, cost = arms[f"{name}/fixed"], arms[f"{name}/cost"]
            draft_ms = statistics.median(fixed.draft_ms)
            verify_ms = statistics.median(fixed.verify_ms)
            tau = fixed.engine.counters.accept_len
            replay = simulate_acceptance(d, target, replies, anchors_per_seq=None).accept_len
            row = {
                "cpu": cpu_info(),
                "variant": name,
                "draft_vocab": d.draft_vocab_size,
                "requests": requests,
                "draft_ms": round(draft_ms, 3),
                "decode_ms": round(decode_ms, 3),
                "ratio": round(draft_ms / decode_ms, 3),
                "verify_ms": round(verify_ms, 3),
                "tau": round(tau, 3),
                "replay_tau": round(replay, 3),
                "predicted_speedup": round(tau * decode_ms / (verify_ms + draft_ms), 3),
                "fixed_speedup": round(speedup(tok_s(fixed), ar_tok_s), 3),
                "cost_speedup": round(speedup(tok_s(cost), ar_tok_s), 3),
                "cost_tau": round(cost.engine.counters.accept_len, 3),
                "outputs_identical_to_ar": sum(
                    fixed.outputs[i] == ar.outputs[i] for i in range(len(prompts))
                ),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {
        "benchmark": "bench/draft_cost.py",
        "drafter": repo_relative(args.drafter),
        "settings": {
            "domains": args.domains,
            "prompts_per_domain": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "dtype": "bfloat16",
            "greedy": True,
        },
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
        "compile_s": built,
        "rows": rows,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


def tok_s(arm: Arm) -> float:
    return sum(len(o) for o in arm.outputs.values()) / arm.spent


if __name__ == "__main__":
    main()
