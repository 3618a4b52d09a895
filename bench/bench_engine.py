"""Engine micro-benchmark on the SmolLM2-135M shapes with random weights.

Measures, in one run and on the same prompts, round time split into draft / verify and output
tokens per second for the verify-length policies ``ar``, ``fixed``, ``head`` and ``cost`` at several
concurrency levels. Random weights mean a random drafter: its drafts are (almost) never
accepted, so these rows measure the *cost* side of speculation. The ``+oracle`` rows replay the
target's own greedy tokens as drafts (a stand-in for a perfect drafter, recorded by the ``ar``
run) to show what the same runtime gains when drafts are accepted. Speed is reported as ratios to
``ar`` at the same concurrency, measured in the same run. ``verify_cost`` is the median time of
one target pass adding n = 1, 4, 8, 16 tokens per request, as a ratio to a decode step (n = 1);
with ``--compile`` it is measured again through the compiled single-request graphs
(``models/decode_graph.py``: decode, and verification widths padded up to 4 / 8 / 16; batch 1
only; the policy rows stay eager so they compare alike).

    python bench/bench_engine.py --out docs/results/engine/bench_engine.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from adaflash.config import DrafterConfig, EngineConfig, SamplingParams, TargetConfig
from adaflash.engine.engine import Engine
from adaflash.hardware import machine
from adaflash.metrics import speedup
from adaflash.models.decode_graph import compiled_route
from adaflash.models.decode_graph import name as graph_name
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.target import PackedBatch, TargetModel

SMOLLM2_135M = TargetConfig(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    eos_token_ids=(2,),
)
MASK_TOKEN_ID = 16  # <empty_output>, an unused code-corpus special of SmolLM2 (SPEC §2)


class ReplayEngine(Engine):
    """Drafts are the target's own continuation, recorded by an earlier ``ar`` run."""

    def __init__(self, *args, continuations: dict[tuple[int, ...], list[int]], **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.continuations = continuations

    def _propose(self):  # type: ignore[no-untyped-def]
        def propose(reqs, states, k_hat):  # type: ignore[no-untyped-def]
            width = int(k_hat.max()) - 1
            out = []
            for r in reqs:
                cont = self.continuations[tuple(r.prompt_ids)]
                done = len(r.output_ids)
                row = cont[done : done + width]
                out.append(row + [0] * (width - len(row)))
            return out, k_hat

        return propose


def verify_cost(
    target: TargetModel, batch: int, context: int, widths: list[int], reps: int
) -> list[dict]:
    compiled = target.decode_graph is not None and batch == 1
    """Median seconds of one target pass that adds ``n`` tokens to each of ``batch`` requests
    with ``context`` tokens cached, for n in ``widths`` (n = 1 is a decode step)."""
    cache = target.new_cache()
    slots = tuple(cache.allocate() for _ in range(batch))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(100, 49000, (batch * context,), generator=g)
    target(PackedBatch(ids, slots, (context,) * batch), cache, logits="none")
    out = []
    for n in widths:
        times = []
        for _ in range(reps):
            new = torch.randint(100, 49000, (batch * n,), generator=g)
            t0 = time.perf_counter()
            target(PackedBatch(new, slots, (n,) * batch), cache)
            times.append(time.perf_counter() - t0)
            for s in slots:
                cache.truncate(s, context)
        out.append(
            {
                "batch": batch,
                "tokens_per_request": n,
                "compiled": compiled,
                "ms": 1e3 * statistics.median(times),
            }
        )
    for row in out:
        row["ratio_to_decode"] = round(row["ms"] / out[0]["ms"], 3)
        row["ms"] = round(row["ms"], 2)
    return out


def run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Prefill every prompt first, then time the decode steps only."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    results: dict = {}
    for p in prompts:
        engine.add_request(
            p, params, on_finish=lambda rec: results.__setitem__(rec.request_id, rec)
        )
    while any(not r.prefill_done for r in engine.running) or engine.waiting or not engine.running:
        engine.step()
    engine.stats.draft_s = engine.stats.verify_s = 0.0
    steps0, tokens0, counters0 = (
        engine.stats.steps,
        engine.stats.output_tokens,
        engine.counters.copy(),
    )
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
    wall = time.perf_counter() - t0
    steps = engine.stats.steps - steps0
    tokens = engine.stats.output_tokens - tokens0
    window = engine.counters - counters0
    return {
        "tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "decode_wall_s": wall,
        "steps": steps,
        "draft_ms_per_step": 1e3 * engine.stats.draft_s / steps,
        "verify_ms_per_step": 1e3 * engine.stats.verify_s / steps,
        "other_ms_per_step": 1e3 * (wall - engine.stats.draft_s - engine.stats.verify_s) / steps,
        "accept_len": window.accept_len,
        "verify_len": window.verify_len,
        "outputs": {tuple(r.prompt_ids): list(r.output_ids) for r in results.values()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--drafter-layers", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=15, help="passes per verify-cost cell")
    ap.add_argument("--compile", action="store_true", help="verify cost compiled too (batch 1)")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", default="docs/results/engine/bench_engine.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    target = TargetModel(SMOLLM2_135M).to(dtype).eval().requires_grad_(False)
    target.fuse()  # the serving layout: fused and (bf16) packed projections
    dcfg = DrafterConfig.for_target(
        SMOLLM2_135M, num_layers=args.drafter_layers, mask_token_id=MASK_TOKEN_ID
    )
    g = torch.Generator().manual_seed(1)
    rows = []
    for c in args.concurrency:
        prompts = [
            torch.randint(100, 49000, (args.prompt_len,), generator=g).tolist() for _ in range(c)
        ]
        base = None
        outputs_ar: dict = {}
        for policy, oracle in [
            ("ar", False),
            ("fixed", False),
            ("head", False),
            ("cost", False),
            ("fixed", True),
            ("head", True),
            ("cost", True),
        ]:
            cfg = EngineConfig(
                policy=policy, max_batch_tokens=16 * max(c, 1), max_running_requests=c
            )
            drafter = DFlashDrafter(dcfg)
            engine = (
                ReplayEngine(target, drafter, cfg, continuations=outputs_ar)
                if oracle
                else Engine(target, drafter, cfg)
            )
            res = run(engine, prompts, args.new_tokens)
            if policy == "ar":
                base, outputs_ar = res["tokens_per_s"], res["outputs"]
            elif oracle:  # lossless check: the replayed drafts do not change the output
                assert res["outputs"] == outputs_ar, "speculative output differs from ar"
            res.pop("outputs")
            name = policy + ("+oracle" if oracle else "")
            rows.append(
                {
                    "method": name,
                    "concurrency": c,
                    **{k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()},
                    "speedup_vs_ar": round(speedup(res["tokens_per_s"], base or 1.0), 3),
                }
            )
            r = rows[-1]
            print(
                f"C={c:<3} {name:<13} {r['tokens_per_s']:7.1f} tok/s  x{r['speedup_vs_ar']:.2f}  "
                f"draft {r['draft_ms_per_step']:6.1f} ms  verify {r['verify_ms_per_step']:6.1f} "
                f"ms  tau {r['accept_len']:.2f}  verify_len {r['verify_len']:.2f}",
                flush=True,
            )
    costs = [
        row
        for c in args.concurrency
        for row in verify_cost(target, c, args.prompt_len, [1, 4, 8, 16], args.reps)
    ]
    compile_s = {}
    if args.compile:
        graph = target.compile_decode((), multi=True, background=False)
        assert graph.ready((), 16), graph.failed or "ADAFLASH_VERIFY_GRAPHS has no width ≥ 16"
        compile_s = {graph_name(key): t for key, t in graph.compile_s.items()}
        costs += verify_cost(target, 1, args.prompt_len, [1, 4, 8, 16], args.reps)
    for row in costs:
        print(
            f"verify cost C={row['batch']:<3} compiled={row['compiled']!s:<5} "
            f"{row['tokens_per_request']:>2} tokens/request "
            f"{row['ms']:7.1f} ms  x{row['ratio_to_decode']:.2f} of a decode step",
            flush=True,
        )
    out = {
        "benchmark": "bench/bench_engine.py",
        "target": "SmolLM2-135M shapes, random weights",
        "drafter": f"DFlash, {args.drafter_layers} layers, random weights",
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "machine": {**machine(), "processor": platform.processor()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "note": args.note,
        "rows": rows,
        "verify_cost": costs,
        "compile_s": {k: round(v, 1) for k, v in compile_s.items()},
        "compiled_route": compiled_route(target),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
