"""Does drafting pay with this drafter here, and does the default policy find it?

One drafter, one domain's eval prompts, at ``--concurrency``: plain decoding (``ar``), every
request verifying a fixed number of tokens (``w2`` … ``w16``: the anchor and w − 1 drafts), and
the default ``cost`` policy twice — ``cost``, a fresh engine each pass (what a short eval sees),
and ``cost-warm``, whose cost model and acceptance profile carry over from pass to pass (what
``serve`` sees; a first pass to learn them is not timed). Every engine runs the compiled steps
``serve`` runs, built before anything is timed. Within each repeat the methods serve the same
prompts side by side, one step each in turn, each timed on its own steps
(``compare.run_lockstep``): a slow spell of a shared machine lands on all of them alike, step
by step. (Until 2026-12-07 each method's pass ran on its own, one after another; on the noisy
AMX Xeon of session 53 ``ar`` swung 34.7–48.8 tok/s between such passes.) ``speedup_over_ar`` is
the median over repeats of a pass's tokens/s ÷ the same repeat's ``ar`` pass.

With several ``--drafter`` folders (an adapting drafter's versions, say), each is measured so,
one after another, against its own ``ar`` passes: does the default policy's tokens/s rise with
the drafter's τ?

``--oracle-right Q`` (one or more values) measures the same methods with a drafter of known
quality instead: each draft slot is the target's own next token (its greedy continuation, from
an untimed ``ar`` pass) with probability Q, else a wrong one — drawn once per prompt and
position, so every method meets the same right and wrong slots — at the drafter's own cost (it
still runs its pass; its drafts are replaced). Where verifying 4 every round pays with it, does
the default policy take that gain? (A reply that leaves the greedy continuation on a bf16
near-tie meets wrong drafts from there on: its acceptance is then below Q.)

    python bench/verify_widths.py --drafter PATH --out docs/results/adapt/…/verify_widths.json
    python bench/verify_widths.py --drafter V0 V1 … --widths 4 --out …
    python bench/verify_widths.py --oracle-right 0.3 0.5 0.7 --widths 4 --out …
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for compare
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo

from compare import run_lockstep  # bench/ is a folder of scripts, not a package

from adaflash.cli import DEFAULT_DRAFTER, encode_prompt
from adaflash.config import EngineConfig, Policy, SamplingParams
from adaflash.engine import policy as policies
from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.engine.round import Propose, stand_in
from adaflash.hardware import cpu_info
from adaflash.models.decode_graph import batch_sizes, compile_now
from adaflash.models.drafter import DFlashDrafter, load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.paths import REPO, repo_relative, write_text_atomic
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts


class FixedWidth(policies.Policy):
    """Every request that can draft verifies ``width`` tokens (the anchor and width − 1
    drafts)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.name = f"w{width}"

    def widths(self, spec, a_hat, ctx) -> torch.Tensor:  # (the Policy's arguments)
        return torch.full((len(spec),), self.width)


class RightSometimes(Engine):
    """Drafts that are the target's greedy continuation of each prompt (``references``) with
    probability ``right`` per slot, drawn once per prompt and position; the drafter's pass
    still runs, for its cost (module docstring)."""

    def __init__(self, *args, references: dict, right: float, **kw) -> None:  # (Engine's)
        super().__init__(*args, **kw)
        self.references, self.right = references, right

    def _propose(self) -> Propose:
        return stand_in(self, self.drafts)

    def drafts(self, r: Request, width: int) -> list[int]:
        ref, at = self.references.get(tuple(r.prompt_ids), []), len(r.output_ids)
        seed = hash(tuple(r.prompt_ids)) % 1_000_003
        out = []
        for pos in range(at, min(at + width, len(ref))):
            right = random.Random(seed * 1_000_003 + pos).random() < self.right
            out.append(ref[pos] if right else (ref[pos] + 1) % self.target.cfg.vocab_size)
        return out + [0] * (width - len(out))  # past the reply: never reached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--drafter", nargs="+", default=[str(REPO / "assets" / "drafters" / DEFAULT_DRAFTER)]
    )
    ap.add_argument("--drafter-note", default="", help="where the drafters came from (kept)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--domain", default="math")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 3, 4, 6, 8, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--eager-drafter",
        action="store_true",
        help="each width also with the drafter's pass eager (what its compiled pass saves)",
    )
    ap.add_argument(
        "--oracle-right",
        type=float,
        nargs="+",
        default=None,
        help="instead of --drafter's drafts, the target's own tokens right with each of these "
        "probabilities per slot (module docstring)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--beside", default="nothing", help="what else ran on the machine meanwhile")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.dtype)
    tok = Tokenizer.from_folder(target_dir)
    drafters = [load_drafter(Path(d), args.dtype) for d in args.drafter]
    c = args.concurrency
    capture = tuple(drafters[0].cfg.target_layer_ids)
    batches = batch_sizes(c) if c > 1 else ()
    compile_s = compile_now(target, [(), capture], batches, drafters[0])
    prompts = [
        encode_prompt(tok, p.prompt, chat=True)
        for p in load_prompts(args.domain, "eval", args.prompts)
    ]
    if args.oracle_right:
        measured = [
            measure(target, tok, drafters[0], prompts, args, right)
            | {"drafter": repo_relative(Path(args.drafter[0])), "oracle_right": right}
            for right in args.oracle_right
        ]
    else:
        measured = [
            measure(target, tok, drafter, prompts, args) | {"drafter": repo_relative(Path(path))}
            for path, drafter in zip(args.drafter, drafters, strict=True)
        ]
    result = {
        "benchmark": "bench/verify_widths.py",
        "args": {**vars(args), "drafter": [repo_relative(Path(d)) for d in args.drafter]},
        "machine": cpu_info(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "compile_s": compile_s,
        **(measured[0] if len(measured) == 1 else {"drafters": measured}),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=1) + "\n")
    print(json.dumps([m["summary"] for m in measured], indent=1))
    print(f"wrote {out}")


def measure(
    target: TargetModel,
    tok: Tokenizer,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    args: argparse.Namespace,
    right: float | None = None,
) -> dict:
    """One drafter: ``ar``, every fixed width, ``cost`` cold and warm, side by side in each
    repeat (module docstring); with ``right``, its drafts those of ``RightSometimes``."""
    c = args.concurrency
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    references: dict[tuple[int, ...], list[int]] = {}

    def engine(policy: Policy, width: int | None = None, eager: bool = False) -> Engine:
        cfg = EngineConfig(
            policy=policy, max_running_requests=c, max_batch_tokens=16 * c, compile=True
        )
        d, eos = None if policy == "ar" else drafter, tok.eos_token_ids
        e = (
            RightSometimes(
                target,
                d,
                cfg,
                drafter_version="bench",
                eos_token_ids=eos,
                references=references,
                right=right,
            )
            if right is not None and d is not None
            else Engine(target, d, cfg, drafter_version="bench", eos_token_ids=eos)
        )
        if width is not None:
            e._policy = FixedWidth(width)
        if eager and e.drafting is not None:
            e.drafting.graph = None
        return e

    if right is not None:  # the answer key: the target's greedy continuations (untimed)
        recs = engine("ar").generate(prompts, params)
        references.update(
            {tuple(p): list(r.output_ids) for p, r in zip(prompts, recs, strict=True)}
        )
    learnt = engine("cost")
    learnt.generate(prompts, params)  # untimed: what passes cost and what the drafter finds

    def warm() -> Engine:
        e = engine("cost")
        e.cost, e._policy = learnt.cost, learnt._policy  # carried over, pass to pass
        return e

    makers: dict[str, Callable[[], Engine]] = {"ar": lambda: engine("ar")}
    for w in args.widths:
        makers[f"w{w}"] = functools.partial(engine, "fixed", w)
        if args.eager_drafter:
            makers[f"w{w}-eager-drafter"] = functools.partial(engine, "fixed", w, True)
    makers["cost"] = lambda: engine("cost")
    makers["cost-warm"] = warm
    runs: dict[str, list[dict]] = {name: [] for name in makers}
    for _ in range(args.repeats):
        engines = {(None, name): make() for name, make in makers.items()}
        for (_, name), run in run_lockstep(engines, prompts, params).items():
            runs[name].append(
                {"tokens_per_s": round(run["tokens_per_s"], 2), "tau": round(run["accept_len"], 4)}
            )
        print(json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    ar = [r["tokens_per_s"] for r in runs["ar"]]
    summary = {
        name: {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "speedup_over_ar": round(
                statistics.median(r["tokens_per_s"] / a for r, a in zip(rs, ar, strict=True)), 3
            ),
            "tau": round(statistics.mean(r["tau"] for r in rs), 4),
        }
        for name, rs in runs.items()
    }
    return {
        "runs": runs,
        "summary": summary,
        "cost_warm_model_ms": {k: round(v, 3) for k, v in learnt.cost.snapshot().items()},
    }


if __name__ == "__main__":
    main()
