"""The data card of the drafter-data shards (``assets/drafter_data/README.md``): what each
namespace holds, by source, what was refused and why, tokens, and a sample of prompts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from adaflash.datagen.job import read_rows

NAMESPACES = {0: "training", 1: "held-out (self-written, seeds never used in training)"}


def totals(folder: Path, seed: int) -> dict:
    """Summed cards of one namespace's sealed shards."""
    out: dict = {"shards": 0, "sequences": 0, "prompt_tokens": 0, "response_tokens": 0}
    by_source: Counter[str] = Counter()
    sampled: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    stopped = seconds = 0.0
    for path in sorted(folder.glob(f"shard-{seed:02d}-*.json")):
        card = json.loads(path.read_text())
        out["shards"] += 1
        for key in ("sequences", "prompt_tokens", "response_tokens"):
            out[key] += card[key]
        by_source.update(card["by_source"])
        sampled.update(card["sampled"])
        refused.update(card["refused"])
        stopped += card["stopped_on_eos"]
        seconds += card["seconds"]
    out |= {
        "by_source": dict(sorted(by_source.items())),
        "sampled": dict(sorted(sampled.items())),
        "refused": dict(sorted(refused.items())),
        "stopped_on_eos": int(stopped),
        "hours": round(seconds / 3600, 2),
    }
    return out


def sample(folder: Path, seed: int, n: int = 8) -> list[str]:
    """The first first-turn prompt of each source in the namespace's first shard."""
    first = sorted(folder.glob(f"shard-{seed:02d}-*.jsonl.gz"))[:1]
    seen: dict[str, str] = {}
    for row in read_rows(first):
        if row["turns"] == 1 and row["source"] not in seen:
            seen[row["source"]] = row["prompt"]
    return [f"{s}: {p}" for s, p in list(seen.items())[:n]]


def write_card(folder: Path) -> Path:
    """Write ``folder/README.md`` from the shards' cards."""
    lines = [
        "# Drafter data: prompts the target wrote itself, and its greedy answers",
        "",
        "Made by `adaflash drafter-data` (`scripts/drafter_data.sh`; `adaflash/datagen/`). Each",
        "`shard-SS-NNNNN.jsonl.gz` row: `id`, `source`, `domain`, `turns` (1, or 2: a second",
        "user turn after the target's first answer), `prompt` (the user turn), `prompt_ids` (the",
        "whole chat-templated prompt), `response_ids` (the target's greedy answer, bf16, at most",
        "256 tokens), `finish_reason`; each `.json` beside it is that shard's card. Sources:",
        "`magpie:<steer>` — user turns the target sampled from its own chat template up to the",
        "user turn (Magpie, arXiv 2406.08464), under its default system prompt or one that",
        "steers the imagined user (code, writing, knowledge, small talk); `stdlib` — tasks on",
        "standard-library functions (implement, explain, complete, test, show a call). Every",
        "eval prompt and the adaptation demo's math prompts are kept out (exact and near",
        "duplicates), and so is every prompt of an earlier shard.",
        "",
    ]
    for seed, name in NAMESPACES.items():
        t = totals(folder, seed)
        if not t["shards"]:
            continue
        lines += [
            f"## Namespace {seed}: {name}",
            "",
            f"{t['shards']} shards, **{t['sequences']:,} sequences**, "
            f"{t['prompt_tokens']:,} prompt and {t['response_tokens']:,} response tokens; "
            f"{t['stopped_on_eos']:,} answers ended on EOS (the rest at the token limit); "
            f"{t['hours']} hours of wall clock (one torch thread, beside other work).",
            "",
            "| source / turn | sequences |",
            "|---|---|",
            *(f"| {k} | {v:,} |" for k, v in t["by_source"].items()),
            "",
            "Candidate user turns sampled: "
            + ", ".join(f"{k} {v:,}" for k, v in t["sampled"].items())
            + ". Refused: "
            + ", ".join(f"{k} {v:,}" for k, v in t["refused"].items() if v)
            + " (`exact` / `near`: duplicates).",
            "",
            "A sample (the first prompt of each source):",
            "",
            *(f"- {s[:200]!r}" for s in sample(folder, seed)),
            "",
        ]
    path = folder / "README.md"
    path.write_text("\n".join(lines))
    return path
