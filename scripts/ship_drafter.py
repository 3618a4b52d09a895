"""Publish a trained drafter folder as the shipped default: copy it without its training logs,
check it loads and fits the 25 MB per-file limit, and extend its model card with the lineage
(chained runs, blocks seen, simulated τ per domain from the learning curve) and, when given,
the served τ per domain from ``bench/eval_drafter.py``.

    python scripts/ship_drafter.py data/drafters/run2 assets/drafters/smollm2-135m-dflash \
        --curve docs/results/drafter/learning_curve.json \
        --eval docs/results/default_drafter_eval.json
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from adaflash.models.drafter import load_drafter

MAX_FILE_BYTES = 25 * 1024 * 1024


def lineage(curve: dict, blocks_seen: int) -> list[str]:
    """Per run: blocks it ended at and its last simulated τ per domain (held-out replay)."""
    runs: dict[str, dict] = {}
    for p in curve["points"]:
        if p["blocks"] <= blocks_seen:
            runs[p.get("run", "")] = p
    lines = ["| run | blocks seen | " + " | ".join(_domains(curve)) + " |"]
    lines.append("|---|---|" + "---|" * len(_domains(curve)))
    for name, p in runs.items():
        taus = [f"{p.get(f'tau_{d}', float('nan')):.2f}" for d in _domains(curve)]
        lines.append(f"| {name} | {p['blocks']:,} | " + " | ".join(taus) + " |")
    return lines


def _domains(curve: dict) -> list[str]:
    return sorted({k[4:] for p in curve["points"] for k in p if k.startswith("tau_")})


def served(result: dict) -> list[str]:
    lines = [
        "| domain | method | τ | verify length | tokens/s | speedup vs ar | identical to ar |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['domain']} | {r['method']} | {r['accept_len']:.2f} | {r['verify_len']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r.get('speedup_vs_ar', 1.0):.2f}× | "
            f"{r.get('outputs_identical_to_ar', '—')}/{r['prompts']} |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", help="trained drafter folder (adaflash train --out)")
    ap.add_argument("out", help="where the shipped drafter goes (replaced)")
    ap.add_argument("--curve", default=None, help="learning-curve JSON of the chained runs")
    ap.add_argument("--eval", default=None, help="bench/eval_drafter.py result for this drafter")
    ap.add_argument("--title", default=None, help="the model card's title (default: the run's)")
    args = ap.parse_args()
    src, out = Path(args.run), Path(args.out)
    load_drafter(src, "float32")  # refuse a folder that does not load
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("logs"))
    for f in tmp.iterdir():
        if f.stat().st_size > MAX_FILE_BYTES:
            raise SystemExit(f"{f.name} is {f.stat().st_size / 2**20:.1f} MB: over the 25 MB limit")
    card = json.loads((tmp / "training.json").read_text())
    blocks = int(card.get("result", {}).get("blocks_seen") or 0)
    text = (tmp / "README.md").read_text().rstrip()
    if args.title:
        card["title"] = args.title
        (tmp / "training.json").write_text(json.dumps(card, indent=2) + "\n")
        text = "\n".join([f"# {args.title}", *text.splitlines()[1:]])
    lines = [text, ""]
    if args.curve:
        curve = json.loads(Path(args.curve).read_text())
        lines += [
            "## Lineage",
            "",
            f"Chained runs (each continues the one before); simulated τ on held-out "
            f"trajectories ({Path(args.curve).as_posix()}):",
            "",
            *lineage(curve, blocks),
            "",
        ]
    if args.eval:
        result = json.loads(Path(args.eval).read_text())
        lines += [
            "## Served (bench/eval_drafter.py)",
            "",
            f"Greedy, {result['dtype']}, concurrency 1, {result['max_new_tokens']} new tokens, "
            f"{result['machine']['threads']} torch thread(s), {result['date']}. "
            + result.get("note", ""),
            "",
            *served(result),
            "",
        ]
    (tmp / "README.md").write_text("\n".join(lines))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    load_drafter(out, "float32")
    print(f"shipped {src} → {out} ({blocks:,} blocks seen)")


if __name__ == "__main__":
    main()
