"""Add a drafter trained outside the chain (``scripts/gpu_recipe.py`` on another machine) to the
learning curve: replay it on the curve's held-out sets exactly as ``adaflash train --curve``
does (``distill.curve_taus`` on the first ``--seqs`` trajectories of each eval file, target in bf16,
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

from adaflash.distill import curve_taus
from adaflash.models.drafter import load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.pull import resolve_target
from adaflash.teacher_cache import CachedSequence, teach
from adaflash.workloads import Trajectory

EVAL = "assets/trajectories/{domain}_eval.jsonl.gz"


def measure(
    folder: str,
    target: TargetModel,
    sets: dict[str, list[Trajectory]],
    taught: dict[tuple[int, ...], dict[str, list[CachedSequence]]],
) -> dict[str, Any]:
    """``curve_taus`` of one drafter folder; ``taught`` keeps the held-out features per set of
    target layers, so drafters of one target share one teacher pass."""
    drafter = load_drafter(folder, "float32").eval()
    layers = tuple(drafter.cfg.target_layer_ids)
    if layers not in taught:
        taught[layers] = {d: teach(target, t, layers, top_k=0) for d, t in sets.items()}
    return curve_taus(drafter, target, taught[layers])


def taus(point: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in point.items() if k.startswith("tau_")}


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
    taught: dict[tuple[int, ...], dict[str, list[CachedSequence]]] = {}
    for folder in args.check:
        point = measure(folder, target, sets, taught)
        print(f"check {folder}: {taus(point)}", flush=True)
    card = json.loads((Path(args.drafter) / "training.json").read_text())
    point = {
        "blocks": int(card["result"]["blocks_seen"]),
        "elapsed_s": card["result"].get("seconds"),
        "draft_loss": card["result"].get("final_draft_loss"),
        **measure(args.drafter, target, sets, taught),
        "run": args.run,
    }
    path = Path(args.curve)
    curve = json.loads(path.read_text())
    curve["points"] = [p for p in curve["points"] if p["blocks"] < point["blocks"]] + [point]
    path.write_text(json.dumps(curve, indent=1) + "\n")
    print(f"appended {args.run}: {taus(point)}")


if __name__ == "__main__":
    main()
