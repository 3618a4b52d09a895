"""What ``cost`` costs where its drafter does not pay: engines in lockstep on the same
prompts (``compare.run_lockstep``, the order of each turn seeded by the repeat), each repeat's
tokens/s ÷ the same repeat's ``ar``:

- ``ar`` — no drafter;
- ``ar+features`` — ``ar`` with the shipped drafter attached: the target pass captures the
  drafter's layers and the engine keeps their features, nobody drafts;
- ``cost-shipped`` / ``cost-weak`` — the default policy with the shipped drafter / with
  ``compare.weak_drafter`` (random weights).

``--engines`` picks which run beside ``ar``. (0e485f1 had a fifth, ``cost-shipped-unsunk``, for
the A/B in docs/results/compare/overhead_ab_sunk_amx_1204.json.)

The cost model and policy of each (engine, C) stay warm across repeats, as the study keeps them.

    python bench/overhead_ab.py --domains code chat --concurrency 1 4 8 16 --repeats 5 \
        --out docs/results/compare/overhead_ab.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for compare
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo

import compare as cmp

from adaflash import hardware
from adaflash.cli import encode_prompt
from adaflash.config import SamplingParams
from adaflash.engine.engine import Engine
from adaflash.models.decode_graph import batch_sizes, compile_now
from adaflash.models.drafter import load_drafter
from adaflash.models.target import load_target
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--domains", nargs="+", default=["code", "chat"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="assets/drafters/smollm2-135m-dflash")
    ap.add_argument(
        "--engines",
        nargs="+",
        default=["ar+features", "cost-shipped", "cost-weak"],
        help="beside ar: ar+features cost-shipped cost-weak",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_target(None)
    target, tok = load_target(folder, "bfloat16"), Tokenizer.from_folder(folder)
    shipped = load_drafter(args.drafter, "float32")
    served = copy.deepcopy(shipped).to(torch.bfloat16).eval()
    weak = cmp.weak_drafter(shipped, 0).to(torch.bfloat16)
    t0 = time.time()
    capture = tuple(served.cfg.target_layer_ids)
    compile_now(target, [(), capture], batch_sizes(max(args.concurrency)), served)
    compile_s = time.time() - t0
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    engines = tuple(
        e
        for e in (
            ("ar", None, "ar"),
            ("ar+features", served, "ar"),
            ("cost-shipped", served, "cost"),
            ("cost-weak", weak, "cost"),
        )
        if e[0] == "ar" or e[0] in args.engines
    )
    warm: dict[tuple[str, int], tuple] = {}
    cells = []
    for domain in args.domains:
        for c in args.concurrency:
            prompts = [
                encode_prompt(tok, p.prompt, chat=True)
                for p in load_prompts(domain, "eval", max(8, c))
            ]
            reps = []
            for rep in range(args.repeats):
                running = {}
                for key, drafter, policy in engines:
                    e = Engine(
                        target,
                        drafter,
                        cmp.cell_config(cmp.ENGINE_POLICY[policy], c),
                        eos_token_ids=tuple(tok.eos_token_ids),
                    )
                    e.cost, e._policy = warm.setdefault((key, c), (e.cost, e._policy))
                    running[key] = e
                cmp.LOCKSTEP_SEED = rep
                out = cmp.run_lockstep(running, prompts, params)
                reps.append(
                    {
                        k: {
                            "tokens_per_s": round(v["tokens_per_s"], 3),
                            "timing_s": {a: round(b, 4) for a, b in v["_timing"].items()},
                            "accept_len": round(v["accept_len"], 4),
                            "verify_len": round(v["verify_len"], 4),
                            "pricing": v.get("_pricing"),
                        }
                        for k, v in out.items()
                    }
                )
            row: dict = {"domain": domain, "concurrency": c, "prompts": len(prompts)}
            for key, *_ in engines[1:]:
                ratios = [r[key]["tokens_per_s"] / r["ar"]["tokens_per_s"] for r in reps]
                med, lo, hi = cmp.spread(ratios)
                row[f"{key}_over_ar"] = {
                    "median": round(med, 4),
                    "min": round(lo, 4),
                    "max": round(hi, 4),
                }
            row["repeats"] = reps
            cells.append(row)
            print(domain, c, {k: v for k, v in row.items() if k.endswith("_over_ar")}, flush=True)
            result = {
                "what": __doc__.split("\n\n")[0],
                "machine": hardware.machine(),
                "threads": args.threads,
                "repeats": args.repeats,
                "max_new_tokens": args.max_new_tokens,
                "compile_s": round(compile_s, 1),
                "note": args.note,
                "cells": cells,
            }
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
