"""Drafter training throughput (blocks/s) before and after the teacher cache, the top-K loss and
the draft vocabulary, and of a batched step, on the default target and real trajectories, in
one run.

- ``before``: the recipe of main 5d025de — the target re-runs every step with full logits, the
  exact OPD loss on full-vocabulary fp32 tensors, the drafter scores all V rows;
- ``cached``: the teacher comes from the cache (top-K), the loss is ``opd_loss_topk``, V rows;
- ``cached+vocab``: the same with a draft vocabulary of ``--vocab`` tokens;
- ``cached+vocab+k8``: the same with block size 8 instead of 16;
- ``cached+vocab+k8+batched``: the same, the step's sequences in one
  drafter pass and one loss (``distill_batch``) instead of one after another.

Each method takes the same sequences and anchors per step; one optimizer step per ``--batch``
sequences (default 1; ``before`` always steps on one).

    python bench/bench_training.py --trajectories data/traj/chat_greedy.jsonl \
        --out docs/results/drafter/training_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from functools import partial
from pathlib import Path

import torch

from adaflash.config import DistillConfig
from adaflash.distill import (
    block_states,
    distill_batch,
    distill_sequence,
    sample_anchors,
    slot_targets,
)
from adaflash.hardware import machine
from adaflash.losses import opd_loss, weighted_slot_mean
from adaflash.models.draft_vocab import build_draft_vocab, count_tokens, lookup_table
from adaflash.models.target import PackedBatch, load_target
from adaflash.pull import resolve_target
from adaflash.teacher_cache import CachedSequence, teach
from adaflash.workloads import read_trajectories
from lightning_modules.train import new_drafter

METHODS = ("before", "cached", "cached+vocab", "cached+vocab+k8", "cached+vocab+k8+batched")


def step_before(drafter, target, traj, *, anchors_n, g) -> int:
    """One step of the old recipe: teacher re-run with full logits + exact full-vocab loss."""
    tokens = traj.prompt_ids + traj.response_ids
    cache = target.new_cache(initial_capacity=len(tokens))
    slot = cache.allocate()
    out = target(
        PackedBatch(torch.tensor(tokens), (slot,), (len(tokens),)),
        cache,
        capture_layers=drafter.cfg.target_layer_ids,
    )
    logits = out.logits.clone()  # (S, V)
    seq = CachedSequence(
        traj.id,
        traj.domain,
        torch.tensor(tokens),
        len(traj.prompt_ids),
        out.features.float().clone(),
        torch.zeros(len(tokens) - 1 - len(traj.prompt_ids), 0, dtype=torch.long),
        torch.zeros(len(tokens) - 1 - len(traj.prompt_ids), 0),
        torch.zeros(len(tokens) - 1 - len(traj.prompt_ids)),
        target.cfg.vocab_size,
    )
    anchors = sample_anchors(seq.prompt_len, len(tokens), anchors_n, g)
    k = drafter.cfg.block_size
    states = block_states(drafter, target, seq, anchors)
    rows, _, valid = slot_targets(seq, anchors, k)
    q = target.lm_head(states[:, 1:].to(target.lm_head.weight.dtype))  # (Nb, k−1, V)
    per = opd_loss(q.flatten(0, 1), logits[rows].flatten(0, 1)).view(rows.shape)
    loss = weighted_slot_mean(per, valid, k)
    loss.backward()
    return anchors.numel()


def step_cached(drafter, target, seqs, *, anchors_n, g, lookup, batched=False) -> int:
    anchors = [sample_anchors(s.prompt_len, s.tokens.numel(), anchors_n, g) for s in seqs]
    if batched:
        outs = distill_batch(drafter, target, seqs, anchors, lookup=lookup)
    else:
        outs = [
            distill_sequence(drafter, target, s, a, lookup=lookup)
            for s, a in zip(seqs, anchors, strict=True)
        ]
    torch.stack([o.loss for o in outs]).mean().backward()
    return sum(a.numel() for a in anchors)


def measure(step, items, opt, warmup: int) -> dict:
    blocks, t0 = 0, None
    for i, item in enumerate(items):
        if i == warmup:
            blocks, t0 = 0, time.perf_counter()
        blocks += step(item)
        opt.step()
        opt.zero_grad(set_to_none=True)
    wall = time.perf_counter() - t0
    return {"blocks": blocks, "seconds": round(wall, 2), "blocks_per_s": round(blocks / wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--trajectories", nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1, help="sequences per optimizer step")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--bf16-autocast", action="store_true")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(resolve_target(None), "bfloat16")
    trajs = [t for t in read_trajectories([Path(p) for p in args.trajectories])]
    n_seqs = (args.steps + args.warmup) * args.batch
    trajs = [t for t in trajs if len(t.response_ids) >= 32][:n_seqs]
    counts = count_tokens((t.response_ids for t in trajs), target.cfg.vocab_size)
    vocab = build_draft_vocab(counts, args.vocab, target.cfg.eos_token_ids)
    cfg = DistillConfig()
    rows = []
    for method in args.methods:
        drafter = new_drafter(
            target, mask_token_id=16, num_layers=3, block_size=8 if "k8" in method else 16
        )
        drafter.float().train()
        if "vocab" in method:
            drafter.set_draft_vocab(vocab)
        lookup = lookup_table(vocab, target.cfg.vocab_size) if "vocab" in method else None
        opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        t_teach = 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16_autocast):
            if method == "before":
                step = partial(step_before, drafter, target, anchors_n=args.anchors, g=g)
                res = measure(step, trajs[:: args.batch], opt, args.warmup)
            else:
                t0 = time.perf_counter()
                seqs = teach(target, trajs, drafter.cfg.target_layer_ids, cfg.top_k)
                t_teach = time.perf_counter() - t0
                step = partial(
                    step_cached,
                    drafter,
                    target,
                    anchors_n=args.anchors,
                    g=g,
                    lookup=lookup,
                    batched=method.endswith("batched"),
                )
                groups = [seqs[i : i + args.batch] for i in range(0, len(seqs), args.batch)]
                res = measure(step, groups, opt, args.warmup)
        row = {"method": method, **res, "teacher_once_s_per_seq": round(t_teach / len(trajs), 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["blocks_per_s"]
    for r in rows:
        r[f"speedup_vs_{rows[0]['method']}"] = round(r["blocks_per_s"] / base, 2)
    out = {
        "benchmark": "bench/bench_training.py",
        "settings": {
            "anchors_per_seq": args.anchors,
            "draft_vocab": args.vocab,
            "drafter_layers": 3,
            "bf16_autocast": args.bf16_autocast,
            "timed_steps": args.steps,
            "sequences_per_step": args.batch,
            "sequences": [t.id for t in trajs],
        },
        "machine": {**machine(), "processor": platform.processor()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
