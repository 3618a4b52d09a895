"""What serving costs while the decode graphs compile in the background (same process).

Each arm runs in its own process: SmolLM2-135M shapes (random weights, bf16, fused), eager
decode steps of ``--batch`` requests timed on a quiet process, then again while
``DecodeGraph`` compiles the one-token graph on its background thread, for ``--seconds``. Arms:
``interpreter`` keeps Python's switch interval (5 ms) during the compile, ``quick`` uses the
engine's ``COMPILE_SWITCH_S`` (what serving does). Reports median step times and their ratio
to the quiet step.

    python bench/compile_contention.py --out docs/results/engine/compile_contention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ARMS = ("interpreter", "quick")


def arm(name: str, batch: int, seconds: float, threads: int) -> dict:
    from bench_engine import SMOLLM2_135M  # this folder is on the path (a script)

    from adaflash.models import decode_graph
    from adaflash.models.target import PackedBatch, TargetModel

    torch.set_num_threads(threads)
    if name == "interpreter":
        decode_graph.COMPILE_SWITCH_S = sys.getswitchinterval()
    torch.manual_seed(0)
    target = TargetModel(SMOLLM2_135M).to(torch.bfloat16).eval()
    target.fuse()
    cache = target.new_cache()
    slots = tuple(cache.allocate() for _ in range(batch))
    target(PackedBatch(torch.randint(100, 49000, (64 * batch,)), slots, (64,) * batch), cache)

    def step() -> float:
        t0 = time.perf_counter()
        ids = torch.randint(100, 49000, (batch,))
        target(PackedBatch(ids, slots, (1,) * batch), cache, logits="last")
        for s in slots:
            cache.truncate(s, 64)
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    quiet = [step() for _ in range(15)]
    graph = target.compile_decode((), False, True)  # the background thread, as `serve` does
    time.sleep(1.0)  # let the compile get going
    t0, during = time.perf_counter(), []
    while time.perf_counter() - t0 < seconds and not graph.graphs:
        during.append(step())
    q, d = statistics.median(quiet), statistics.median(during)
    return {
        "arm": name,
        "switch_interval_s": decode_graph.COMPILE_SWITCH_S,
        "quiet_step_ms": round(1e3 * q, 2),
        "during_compile_step_ms": round(1e3 * d, 2),
        "slowdown": round(d / q, 2),
        "steps_timed": len(during),
        "compile_finished_within_window": bool(graph.graphs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child
    ap.add_argument("--note", default="quiet machine: nothing else ran")
    ap.add_argument("--out", default="docs/results/engine/compile_contention.json")
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm, args.batch, args.seconds, args.threads)), flush=True)
        os._exit(0)  # the compile thread may still run: do not wait for it
    from adaflash.hardware import machine
    from adaflash.models.decode_graph import routes

    rows = []
    for name in ARMS:
        cmd = [sys.executable, __file__, "--arm", name]
        cmd += ["--batch", str(args.batch), "--seconds", str(args.seconds)]
        cmd += ["--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    result = {
        "benchmark": "bench/compile_contention.py",
        "settings": {
            "batch": args.batch,
            "seconds": args.seconds,
            # the compiled steps' candidate routes (several: timed on the first graph)
            "routes": [r.as_dict() for r in routes()],
        },
        "machine": machine() | {"threads": args.threads},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
