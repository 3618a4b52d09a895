"""Add a drafter trained outside the chain (``scripts/gpu_recipe.py`` on another machine) to the
learning curve: replay it on the curve's held-out sets exactly as ``adaflash train --curve``
does (the first ``--seqs`` trajectories of each eval file, 32 anchors, seed 0, target in bf16,
drafter in fp32) and append the point at the drafter's cumulative blocks seen. ``--check``
drafters are measured the same way and only printed (to see how far a re-measure of a point
already on the curve moves on this machine).

    python scripts/curve_point.py /tmp/gpu_run --run "gpu run 1 (H200)" \
        --check assets/drafters/smollm2-135m-dflash \
        --curve docs/results/drafter/learning_curve.json
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

import torch

from adaflash.distill import replay
from adaflash.models.drafter import load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.pull import resolve_target
from adaflash.teacher_cache import teach
from adaflash.workloads import Trajectory

EVAL = "assets/trajectories/{domain}_eval.jsonl.gz"


def measure(folder: str, target: TargetModel, sets: dict[str, list[Trajectory]]) -> dict[str, Any]:
    drafter = load_drafter(folder, "float32").eval()
    point: dict[str, Any] = {}
    for domain, trajs in sets.items():
        seqs = teach(target, trajs, drafter.cfg.target_layer_ids, top_k=0)
        c = replay(drafter, target, seqs, anchors_per_seq=32, seed=0)
        point[f"tau_{domain}"] = round(c.accept_len, 4)
        point[f"slots_{domain}"] = [None if a is None else round(a, 4) for a in c.slot_acceptance]
    return point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("drafter", help="drafter folder with training.json (result.blocks_seen)")
    ap.add_argument("--run", required=True, help="the point's run name on the curve")
    ap.add_argument("--curve", default="docs/results/drafter/learning_curve.json")
    ap.add_argument("--check", nargs="*", default=[], help="drafters to measure and print only")
    ap.add_argument("--domains", nargs="+", default=["chat", "code", "math"])
    ap.add_argument("--seqs", type=int, default=32, help="held-out sequences per domain")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(resolve_target(None), "bfloat16")
    sets = {}
    for d in args.domains:
        with gzip.open(EVAL.format(domain=d), "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        sets[d] = [Trajectory(**r) for r in rows][: args.seqs]
    for folder in args.check:
        taus = {k: v for k, v in measure(folder, target, sets).items() if k.startswith("tau_")}
        print(f"check {folder}: {taus}", flush=True)
    card = json.loads((Path(args.drafter) / "training.json").read_text())
    point = {
        "blocks": int(card["result"]["blocks_seen"]),
        "elapsed_s": card["result"].get("seconds"),
        "draft_loss": card["result"].get("final_draft_loss"),
        **measure(args.drafter, target, sets),
        "run": args.run,
    }
    path = Path(args.curve)
    curve = json.loads(path.read_text())
    curve["points"] = [p for p in curve["points"] if p["blocks"] < point["blocks"]] + [point]
    path.write_text(json.dumps(curve, indent=1) + "\n")
    print(f"appended {args.run}: { ({k: v for k, v in point.items() if k.startswith('tau_')}) }")


if __name__ == "__main__":
    main()
