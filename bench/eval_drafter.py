"""Per-domain acceptance length τ and speedup of a drafter, served through the engine.

For each domain's eval prompts (chat template applied) this runs plain decoding (``ar``) and the
drafter with the ``fixed`` policy (DFlash baseline, k̂ = k), ``head`` and ``cost`` — one
request at a time (concurrency 1), greedy, in one process, and reports τ, verify length and
tokens/s, with speedup = tokens/s ÷ ``ar`` tokens/s on the same prompts. Greedy outputs of every
method are checked token-identical to ``ar`` (fp32) or counted as differing (bf16 can flip a
near-tie between a batched and a one-token pass). ``simulated_accept_len`` replays the drafter
against the ``ar`` replies as training measures it (every anchor, whole block verified): the τ
that ``fixed`` should serve on these prompts, so a gap between the two points at serving.

    python bench/eval_drafter.py --drafter assets/drafters/smollm2-135m-dflash \
        --out docs/results/default_drafter_eval.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from adaflash.cli import encode_prompt
from adaflash.config import EngineConfig, SamplingParams
from adaflash.distill import simulate_acceptance
from adaflash.engine.engine import Engine
from adaflash.hardware import machine
from adaflash.metrics import speedup
from adaflash.models.drafter import load_drafter
from adaflash.models.target import load_target
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts


def run_method(
    target, drafter, tok, policy: str, prompts: list[list[int]], params: SamplingParams
) -> dict:
    engine = Engine(
        target,
        drafter if policy != "ar" else None,
        EngineConfig(policy=policy, max_running_requests=1),
        detokenize=tok.decode,
        eos_token_ids=tuple(tok.eos_token_ids),
    )
    t0 = time.perf_counter()
    outputs = [engine.generate([p], params)[0].output_ids for p in prompts]  # concurrency 1
    wall = time.perf_counter() - t0
    c = engine.counters
    return {
        "tokens_per_s": engine.stats.output_tokens / wall,
        "output_tokens": engine.stats.output_tokens,
        "wall_s": wall,
        "accept_len": c.accept_len,
        "verify_len": c.verify_len,
        "acceptance_rate": c.acceptance_rate,
        "slot_acceptance": c.slot_acceptance,
        "draft_ms_per_step": 1e3 * engine.stats.draft_s / max(engine.stats.steps, 1),
        "verify_ms_per_step": 1e3 * engine.stats.verify_s / max(engine.stats.steps, 1),
        "_outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--domains", nargs="+", default=["chat", "math", "code", "blend"])
    ap.add_argument("--prompts", type=int, default=16, help="eval prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["ar", "fixed", "head", "cost"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.dtype)
    tok = Tokenizer.from_folder(target_dir)
    drafter = load_drafter(args.drafter, args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for domain in args.domains:
        prompts = [
            encode_prompt(tok, p.prompt, chat=True)
            for p in load_prompts(domain, "eval", args.prompts)
        ]
        results = {m: run_method(target, drafter, tok, m, prompts, params) for m in args.methods}
        ref = results["ar"]["_outputs"] if "ar" in results else None
        # τ the training-side replay predicts for the same replies (every anchor, the whole
        # block verified): what `fixed` should serve if serving and training agree
        sim = (
            None
            if ref is None
            else simulate_acceptance(
                drafter,
                target,
                [(list(p) + list(o), len(p)) for p, o in zip(prompts, ref, strict=True)],
                anchors_per_seq=None,
            ).accept_len
        )
        for m, r in results.items():
            outs = r.pop("_outputs")
            row = {
                "domain": domain,
                "method": m,
                "prompts": len(prompts),
                **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
                "simulated_accept_len": None if sim is None else round(sim, 4),
            }
            if ref is not None:
                row["speedup_vs_ar"] = round(
                    speedup(r["tokens_per_s"], results["ar"]["tokens_per_s"]), 3
                )
                row["outputs_identical_to_ar"] = sum(a == b for a, b in zip(outs, ref, strict=True))
            rows.append(row)
            print(
                f"{domain:<6} {m:<6} tau {row['accept_len']:.2f}  verify_len "
                f"{row['verify_len']:.2f}  {row['tokens_per_s']:.1f} tok/s  "
                f"x{row.get('speedup_vs_ar', 1):.2f}  identical "
                f"{row.get('outputs_identical_to_ar')}/{len(prompts)}",
                flush=True,
            )
    out = {
        "benchmark": "bench/eval_drafter.py",
        "drafter": str(args.drafter),
        "target": Path(target_dir).name,  # the model, not this machine's cache path
        "dtype": args.dtype,
        "concurrency": 1,
        "greedy": True,
        "max_new_tokens": args.max_new_tokens,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
