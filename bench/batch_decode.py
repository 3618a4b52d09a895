"""Plain batched decoding throughput by concurrency — what drafter-training data costs
(``adaflash regenerate`` runs the target this way) — with the batched attention in float32 and in
the KV cache's dtype, in one run.

Each cell starts ``B`` requests on the shipped code-train prompts, prefills them, then times
``--steps`` decode steps (every request adds one token per step; ``ignore_eos`` keeps the batch
full). ``attention`` is the working dtype of the batched decode attention
(``models/batch_attention.py``): ``auto`` is what the engine picks on this CPU, ``cache`` forces
the cache's dtype (bf16) as on CPUs with native bf16.

    python bench/batch_decode.py --threads 2 --out docs/results/engine/batch_decode.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaflash.cli import build_engine, encode_prompt
from adaflash.config import EngineConfig, SamplingParams
from adaflash.hardware import machine, native_bf16
from adaflash.models import batch_attention
from adaflash.pull import resolve_target
from adaflash.workloads import load_prompts


def run_cell(batch: int, steps: int, attention: str, threads: int | None) -> dict:
    batch_attention.native_bf16 = (lambda: True) if attention == "cache" else native_bf16
    cfg = EngineConfig(
        policy="ar",
        dtype="bfloat16",
        num_threads=threads,
        max_running_requests=batch,
        max_batch_tokens=max(512, batch * 16),
    )
    engine, tok = build_engine(resolve_target(None), None, cfg)
    for p in load_prompts("code", "train")[:batch]:
        ids = encode_prompt(tok, p.prompt, chat=True)
        engine.add_request(ids, SamplingParams(max_new_tokens=steps + 8, ignore_eos=True))
    while engine.stats.output_tokens < batch:  # every prompt prefilled, first token out
        engine.step()
    engine.step()  # one warm decode step
    n0, t0 = engine.stats.output_tokens, time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    return {
        "batch": batch,
        "attention": attention,
        "ms_per_step": round(1e3 * dt / steps, 2),
        "tok_s": round((engine.stats.output_tokens - n0) / dt, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per cell")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default="docs/results/engine/batch_decode.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = ["auto"] if native_bf16() else ["auto", "cache"]  # the same path where bf16 is native
    rows = []
    for b in args.batches:
        for mode in modes:
            rows.append(run_cell(b, args.steps, mode, args.threads))
            print(json.dumps(rows[-1]), flush=True)
    best = max((r for r in rows if r["attention"] == "auto"), key=lambda r: r["tok_s"])
    out = {
        "benchmark": "bench/batch_decode.py",
        "settings": {"steps": args.steps, "dtype": "bfloat16", "prompts": "code train"},
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
        "best_batch": best["batch"],
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"best: batch {best['batch']}, {best['tok_s']} tok/s → {args.out}")


if __name__ == "__main__":
    main()
