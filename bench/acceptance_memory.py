"""How much does a request's last round say about its next? The cost policy's memory, measured.

The ``cost`` policy plans each request by its own acceptance profile: decayed counts of each
draft slot accepted (``DECAY`` per verified round), shrunk towards the engine-wide profile with
``PRIOR_WEIGHT`` rounds of it (``policy.shrunk_rate``). A short memory with a weak prior bets
that acceptance comes in streaks — a miss says the next round will miss too; a long one with a
strong prior, that requests differ but rounds do not.

This script lets the data decide. Each domain's eval prompts are served with every round
verifying the whole block (the ``fixed`` policy, so every slot up to the first miss is measured
every round), one request at a time, greedy, and each request's accepted drafts per round are
kept. Then, per domain:

- ``after``: the next round's P(≥ 1 draft accepted), P(≥ 2) and mean accepted (capped at 3)
  after a round that accepted none, one or more, three or more — streaks would show as a lower
  rate after a miss;
- ``requests``: each request's rounds and mean accepted (how much requests differ);
- ``scores``: for each (decay, prior weight), the Brier score of the estimator's prediction of
  slots 1–3 (each slot as ``reached`` counts it: given every slot before it was accepted) before
  every round, from the request's rounds so far and, as the prior, the other requests' rates
  (leave-one-out): lower is better. ``current`` is the policy's constants, ``best`` the lowest.

    python bench/acceptance_memory.py --out docs/results/policy/acceptance_memory.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from adaflash.cli import DEFAULT_DRAFTER, encode_prompt
from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine import policy as policies
from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.hardware import cpu_info
from adaflash.models.drafter import load_drafter
from adaflash.models.target import load_target
from adaflash.paths import REPO, repo_relative, write_text_atomic
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts

SLOTS = 3  # the slots scored: where the policy's plans at one request mostly end (widths 2–4)
DECAYS = (0.8, 0.9, 0.95, 0.98, 0.995)
WEIGHTS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


class Recorder(policies.Policy):
    """``fixed`` (every request verifies the whole block), keeping each request's accepted
    drafts per round."""

    def __init__(self) -> None:
        self.rounds: dict[str, list[int]] = {}

    def observe(self, r: Request, verify_len: int, accepted: int, block_size: int) -> None:
        self.rounds.setdefault(r.id, []).append(accepted)
        super().observe(r, verify_len, accepted, block_size)


def after(seqs: list[list[int]]) -> dict[str, dict[str, float]]:
    """The next round's acceptance after a round of each kind (module docstring)."""
    kinds = {
        "none": lambda a: a == 0,
        "one_or_more": lambda a: a >= 1,
        "three_or_more": lambda a: a >= 3,
    }
    out = {}
    for name, kind in kinds.items():
        nxt = [a for s in seqs for prev, a in itertools.pairwise(s) if kind(prev)]
        n = max(len(nxt), 1)
        out[name] = {
            "rounds": len(nxt),
            "p_at_least_1": round(sum(a >= 1 for a in nxt) / n, 4),
            "p_at_least_2": round(sum(a >= 2 for a in nxt) / n, 4),
            "mean_accepted_cap3": round(sum(min(a, 3) for a in nxt) / n, 4),
        }
    return out


def slot_rates(seqs: list[list[int]], slots: int = SLOTS) -> list[float]:
    """Per slot i: accepted ÷ reached over all rounds (slot i reached when the i slots before it
    were accepted; ``reached`` with the whole block verified)."""
    rates = []
    for i in range(slots):
        reach = [a for s in seqs for a in s if a >= i]
        rates.append(sum(a > i for a in reach) / max(len(reach), 1))
    return rates


def brier(seqs: list[list[int]], decay: float, weight: float, slots: int = SLOTS) -> float:
    """The estimator's Brier score over every reached slot < ``slots`` of every round, each
    predicted before its round (``policy.count_slots``, ``policy.shrunk_rate``); the prior is the
    other requests' ``slot_rates``."""
    total, n = 0.0, 0
    for j, s in enumerate(seqs):
        prior = slot_rates(seqs[:j] + seqs[j + 1 :], slots)
        seen, ok = [0.0] * slots, [0.0] * slots
        for a in s:
            reached = range(min(slots, a + 1))  # as ``policies.reached`` with every slot verified
            for i in reached:
                p = policies.shrunk_rate(ok[i], seen[i], prior[i], weight)
                total += (p - float(i < a)) ** 2
                n += 1
            policies.count_slots(seen, ok, reached, a, decay)
    return total / max(n, 1)


def scores(seqs: list[list[int]]) -> dict:
    """Every (decay, weight) on the grid, the policy's own constants, and the best."""
    grid = {f"{d}/{w}": round(brier(seqs, d, w), 5) for d in DECAYS for w in WEIGHTS}
    current = f"{policies.DECAY}/{policies.PRIOR_WEIGHT}"
    grid.setdefault(current, round(brier(seqs, policies.DECAY, policies.PRIOR_WEIGHT), 5))
    best = min(grid, key=grid.__getitem__)
    return {"grid": grid, "current": {current: grid[current]}, "best": {best: grid[best]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--drafter", default=str(REPO / "assets" / "drafters" / DEFAULT_DRAFTER))
    ap.add_argument("--drafter-note", default="", help="where the drafter came from (kept)")
    ap.add_argument("--domains", nargs="+", default=["math", "code", "chat"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = resolve_target(None)
    target = load_target(target_dir, args.dtype)
    tok = Tokenizer.from_folder(target_dir)
    drafter = load_drafter(Path(args.drafter), args.dtype)
    domains = {}
    for domain in args.domains:
        prompts = [
            encode_prompt(tok, p.prompt, chat=True)
            for p in load_prompts(domain, "eval", args.prompts)
        ]
        engine = Engine(
            target,
            drafter,
            EngineConfig(policy="fixed", max_running_requests=1, compile=False),
            eos_token_ids=tok.eos_token_ids,
        )
        recorder = engine._policy = Recorder()
        engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
        seqs = list(recorder.rounds.values())
        scored = scores(seqs)
        domains[domain] = {
            "rounds": sum(map(len, seqs)),
            "mean_accepted": round(statistics.fmean(a for s in seqs for a in s), 4),
            "slot_rates": [round(x, 4) for x in slot_rates(seqs)],
            "after": after(seqs),
            "requests": [
                {"rounds": len(s), "mean_accepted": round(statistics.fmean(s), 4)} for s in seqs
            ],
            "scores": scored,
            "accepted": seqs,
        }
        print(domain, json.dumps(domains[domain]["after"]))
        print(domain, "current", scored["current"], "best", scored["best"])
    result = {
        "benchmark": "bench/acceptance_memory.py",
        "args": {**vars(args), "drafter": repo_relative(Path(args.drafter))},
        "policy": {"decay": policies.DECAY, "prior_weight": policies.PRIOR_WEIGHT},
        "machine": cpu_info(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "domains": domains,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
