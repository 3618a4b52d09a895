"""Draw the drafter's learning curve (``adaflash train --curve FILE``): simulated τ on held-out
trajectories per domain against blocks seen, across chained runs.

    python scripts/plot_learning_curve.py docs/results/drafter/learning_curve.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from matplotlib.figure import Figure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("curve", help="learning-curve JSON")
    ap.add_argument("--out", default=None, help="PNG (default: next to the JSON)")
    args = ap.parse_args()
    path = Path(args.curve)
    points = json.loads(path.read_text())["points"]
    fig = Figure(figsize=(7.5, 3.6), dpi=110)
    ax = fig.add_subplot()
    domains = sorted({k[4:] for p in points for k in p if k.startswith("tau_")})
    for d in domains:
        xs = [p["blocks"] / 1e3 for p in points if f"tau_{d}" in p]
        ys = [p[f"tau_{d}"] for p in points if f"tau_{d}" in p]
        ax.plot(xs, ys, marker=".", label=d)
    runs = [(p["blocks"], p.get("run", "")) for p in points]
    for (b, run), (_, prev) in zip(runs[1:], runs[:-1], strict=True):
        if run != prev:
            ax.axvline(b / 1e3, color="#999", ls="--", lw=0.8)
    ax.set_xlabel("training blocks seen (thousands)")
    ax.set_ylabel("simulated τ (held out, k̂ = k)")
    ax.set_title("drafter learning curve (dashed: a chained run starts)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.set_layout_engine("tight")
    out = Path(args.out) if args.out else path.with_suffix(".png")
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
