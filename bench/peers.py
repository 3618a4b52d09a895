"""AdaFlash against the engines a user could run instead, on this machine, in one run.

Engines (each generating exactly --new-tokens greedy tokens per prompt after the chat-templated
prompt, EOS ignored, so every engine does the same work):

- ``adaflash-ar``: our engine, plain decoding (bf16), batch-1 steps compiled as a user gets by
  default (``models/decode_graph.py``; compiled before the rounds, the time is recorded);
- ``adaflash-ar-eager``: the same without the compiled step (``--no-compile`` drops compiled rows);
- ``adaflash-head`` / ``adaflash-cost``: our engine with a drafter (speculative), verify length
  from the length head / from the online cost model (which may not draft at all);
- ``hf``: Hugging Face transformers ``generate`` (bf16, left-padded batches);
- ``llamacpp-bf16`` / ``llamacpp-q4_1``: llama.cpp through llama-cpp-python's low-level API, one
  ``llama_decode`` per step for the whole batch (sequence ids), greedy argmax on its logits; each
  in a process of its own (``bench/llamacpp_peer.py``), which waits while the others run.

Every engine first runs ``--warmup`` untimed short generations per batch size (without them,
the first batch-1 round after compiling ran at 25.5 tok/s, the next two at 101.6 and 92.2).
Rounds are interleaved (engine A, B, C, … then again), and each cell reports the median and the
min/max over rounds. ``ms_per_step`` is wall time per decode step after the prefill.
llama.cpp is optional (``pip install 'adaflash[bench]'``, built from source, about 20 minutes;
``scripts/peer_models.sh`` builds it and makes the GGUF files).

    python bench/peers.py --threads 2 --batches 1 8 32 --rounds 3 \
        --gguf-bf16 ~/.cache/adaflash/gguf/smollm2-135m-instruct-bf16.gguf \
        --gguf-q4 ~/.cache/adaflash/gguf/smollm2-135m-instruct-q4_1.gguf \
        --out docs/results/engine/peers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from adaflash.cli import default_drafter, encode_prompt
from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.hardware import cpu_info
from adaflash.models.decode_graph import batch_sizes, compile_now, compiled_route
from adaflash.models.drafter import load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.paths import repo_relative
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts

Run = Callable[[list[list[int]], int], tuple[float, float]]  # → (tok/s, ms per decode step)


def adaflash_runner(target: TargetModel, drafter, policy: str, compiled: bool = True) -> Run:  # type: ignore[no-untyped-def]
    graph = target.decode_graph

    def run(prompts: list[list[int]], new: int) -> tuple[float, float]:
        target.decode_graph = graph if compiled else None
        engine = Engine(
            target,
            drafter if policy != "ar" else None,
            EngineConfig(
                policy=policy,
                max_running_requests=len(prompts),
                max_batch_tokens=max(512, 16 * len(prompts)),
                max_prefill_tokens=4096,
            ),
        )
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        return engine.stats.output_tokens / wall, 1e3 * wall / engine.stats.steps

    return run


def hf_runner(folder: Path, pad_id: int) -> Run:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()

    def run(prompts: list[list[int]], new: int) -> tuple[float, float]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        wall = time.perf_counter() - t0
        return len(prompts) * new / wall, 1e3 * wall / new

    return run


class LlamaCppPeer:
    """llama.cpp in a process of its own (``bench/llamacpp_peer.py``): in this process, torch's
    OpenMP threads, busy from the engines before it, slowed it down (BF16 38.0 vs 51.4 tok/s alone
    at batch 1, AVX-512 Xeon). The child answers one JSON line per round."""

    def __init__(self, path: Path, threads: int, max_batch: int) -> None:
        script = Path(__file__).with_name("llamacpp_peer.py")
        cmd = [sys.executable, str(script), str(path), str(threads), str(max_batch)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp peer exited ({self.proc.wait()})")
        tps, ms = json.loads(line)
        return tps, ms


ENGINES = (
    "adaflash-ar",
    "adaflash-ar-eager",
    "adaflash-head",
    "adaflash-cost",
    "hf",
    "llamacpp-bf16",
    "llamacpp-q4_1",
)


def paired_ratios(rows: list[dict], batches: list[int], ours: str = "adaflash-ar") -> list[str]:
    """Lines of ``ours`` ÷ each llama.cpp engine, round by round (the same round's prompts, run
    back to back, so a slow spell of the host falls on both), and their median."""
    out = []
    for b in batches:
        mine = next((r for r in rows if r["engine"] == ours and r["batch"] == b), None)
        if mine is None:
            continue
        for peer in (r for r in rows if r["engine"].startswith("llamacpp") and r["batch"] == b):
            pairs = zip(mine["tok_s_rounds"], peer["tok_s_rounds"], strict=True)
            ratios = [a / p for a, p in pairs]
            shown = ", ".join(f"{x:.2f}" for x in ratios)
            out.append(
                f"\nbatch {b}: {ours} ÷ {peer['engine']} per round {shown} "
                f"(median {statistics.median(ratios):.2f}×)"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1, help="untimed short runs per engine first")
    ap.add_argument("--engines", nargs="+", default=None, help="subset of the engines")
    ap.add_argument("--drafter", default=None, help="drafter of adaflash-head (default: shipped)")
    ap.add_argument("--gguf-bf16", default=None)
    ap.add_argument("--gguf-q4", default=None)
    ap.add_argument("--no-compile", action="store_true", help="eager batch-1 steps only")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for engine, flag, gguf in (
        ("llamacpp-bf16", "--gguf-bf16", args.gguf_bf16),
        ("llamacpp-q4_1", "--gguf-q4", args.gguf_q4),
    ):
        if args.engines and engine in args.engines and not gguf:  # asked for, but no file
            ap.error(f"{engine} needs {flag} FILE (scripts/peer_models.sh makes it)")
        if gguf and not Path(gguf).is_file():
            ap.error(f"{flag}: no such file: {gguf}")
    unknown = set(args.engines or ()) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engine(s) {sorted(unknown)}; choose from {list(ENGINES)}")
    torch.set_num_threads(args.threads)
    folder = resolve_target(None)
    tok = Tokenizer.from_folder(folder)
    target = load_target(folder, "bfloat16")
    drafter_dir = args.drafter or default_drafter()
    drafter = load_drafter(drafter_dir, "bfloat16") if drafter_dir else None
    texts = [p.prompt for p in load_prompts("chat", "eval")]
    compile_s: dict[str, float] = {}
    if not args.no_compile:  # what `serve` compiles in the background, here before timing
        speculative = not args.engines or {"adaflash-head", "adaflash-cost"} & set(args.engines)
        graphs = [()] + (
            [tuple(drafter.cfg.target_layer_ids)] if drafter is not None and speculative else []
        )
        spec = drafter if drafter is not None and speculative else None
        compile_s = compile_now(target, graphs, batch_sizes(max(args.batches)), spec)
    route = compiled_route(target)
    runners: dict[str, Run] = {"adaflash-ar": adaflash_runner(target, None, "ar")}
    if not args.no_compile:
        runners["adaflash-ar-eager"] = adaflash_runner(target, None, "ar", compiled=False)
    if drafter is not None:
        runners["adaflash-head"] = adaflash_runner(target, drafter, "head")
        runners["adaflash-cost"] = adaflash_runner(target, drafter, "cost")
    runners["hf"] = hf_runner(folder, tok.eos_token_ids[0])
    max_b = max(args.batches)
    if args.gguf_bf16:
        runners["llamacpp-bf16"] = LlamaCppPeer(Path(args.gguf_bf16), args.threads, max_b).run
    if args.gguf_q4:
        runners["llamacpp-q4_1"] = LlamaCppPeer(Path(args.gguf_q4), args.threads, max_b).run
    if args.engines:
        runners = {k: v for k, v in runners.items() if k in args.engines}
    for b in args.batches:  # untimed: one-time costs (first steps after compiling, oneDNN kernels)
        prompts = [encode_prompt(tok, texts[i % len(texts)], True) for i in range(b)]
        for _ in range(args.warmup):
            for run in runners.values():
                run(prompts, 16)
    cells: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rnd in range(args.rounds):
        for b in args.batches:
            prompts = [
                encode_prompt(tok, texts[(rnd * b + i) % len(texts)], True) for i in range(b)
            ]
            for name, run in runners.items():
                cells.setdefault((name, b), []).append(run(prompts, args.new_tokens))
                tps, ms = cells[(name, b)][-1]
                print(
                    f"round {rnd} batch {b:>2} {name:<14} {tps:7.1f} tok/s {ms:7.1f} ms/step",
                    flush=True,
                )
    rows = []
    for (name, b), vals in cells.items():
        tps = [v[0] for v in vals]
        rows.append(
            {
                "engine": name,
                "batch": b,
                "tok_s": round(statistics.median(tps), 2),
                "tok_s_min": round(min(tps), 2),
                "tok_s_max": round(max(tps), 2),
                "tok_s_rounds": [round(t, 2) for t in tps],  # in round order: pair engines by round
                "ms_per_step": round(statistics.median(v[1] for v in vals), 2),
                "threads": args.threads,
            }
        )
    out = {
        "benchmark": "bench/peers.py",
        "settings": {
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "warmup_runs": args.warmup,
            "prompts": "workloads/chat_eval.jsonl, chat template",
            "drafter": repo_relative(drafter_dir) if drafter_dir else None,
            "compiled_decode": not args.no_compile,
            "compile_s": compile_s,  # per graph; [] = plain decoding
            "compiled_route": route,  # GEMV kernel / autotuned GEMMs (decode_graph.Route)
            "note": args.note,
        },
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu_info(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    lines = ["| engine | " + " | ".join(f"batch {b} tok/s" for b in args.batches) + " |"]
    lines.append("|---|" + "---|" * len(args.batches))
    for name in runners:
        cellz = []
        for b in args.batches:
            r = next(x for x in rows if x["engine"] == name and x["batch"] == b)
            cellz.append(f"{r['tok_s']:.1f} ({r['tok_s_min']:.0f}–{r['tok_s_max']:.0f})")
        lines.append(f"| {name} | " + " | ".join(cellz) + " |")
    lines += paired_ratios(rows, args.batches)
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
