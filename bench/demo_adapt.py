"""Online adaptation demo: the chat-only drafter learns math while it serves (paper Fig. 2a).

For each arm (OPD = AdaFlash's loss, OSD = forward-KL baseline), in one run:

1. a fresh SQLite buffer and weights folder; the shipped drafter registered as ``v0000``;
2. the engine serves math train prompts in chunks (greedy, concurrency ``--concurrency``); its
   records flow through the bounded queue and the writer into the buffer;
3. a real ``adaflash trainer`` process (own process, 1 thread) trains when ``--chunk`` new
   trajectories exist, publishes a version, gates it, and promotes or rejects it;
4. the engine hot-swaps each promoted version (``VersionWatcher``) between steps;
5. after every round, the serving drafter is measured on held-out math eval prompts and on chat
   eval prompts (forgetting): τ and tokens/s with the ``fixed`` policy (drafter quality, the
   DFlash/OSD way of serving) and with the ``head`` policy (AdaFlash).

Serving and training are serialized here (serve a chunk, then wait for the round) so the per-
version numbers are not disturbed by the trainer sharing the two CPU cores; ``adaflash serve``
runs them concurrently. Writes ``adapt.json`` and ``adapt.png`` under ``--out``.

    python bench/demo_adapt.py --out docs/results/adapt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from adaflash.cli import DEFAULT_DRAFTER, encode_prompt
from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.engine.records import QueueSink
from adaflash.hardware import cpu_info
from adaflash.models.target import TargetModel, load_target
from adaflash.paths import REPO, repo_relative
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts
from app.training.hotswap import VersionWatcher
from db.buffer import BufferWriter
from db.registry import Registry
from db.runs import list_runs
from db.session import make_engine, migrate


def measure(
    target: TargetModel,
    registry: Registry,
    version: str,
    tok: Tokenizer,
    prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> dict:
    """τ and tokens/s of one version on each eval domain, for the fixed and head policies."""
    out: dict = {}
    drafter = registry.load(version, args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for domain, plist in prompts.items():
        for policy in ("fixed", "head"):
            engine = Engine(
                target,
                drafter,
                EngineConfig(
                    policy=policy,
                    max_running_requests=args.concurrency,
                    max_batch_tokens=16 * args.concurrency,
                ),
                drafter_version=version,
                eos_token_ids=tok.eos_token_ids,
            )
            t0 = time.perf_counter()
            engine.generate(plist, params)
            wall = time.perf_counter() - t0
            c = engine.counters
            out[f"{domain}/{policy}"] = {
                "accept_len": round(c.accept_len, 4),
                "verify_len": round(c.verify_len, 4),
                "acceptance_rate": round(c.acceptance_rate, 4),
                "tokens_per_s": round(engine.stats.output_tokens / wall, 2),
            }
    return out


def measure_ar(
    target: TargetModel,
    tok: Tokenizer,
    prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> dict:
    out = {}
    for domain, plist in prompts.items():
        engine = Engine(
            target,
            None,
            EngineConfig(policy="ar", max_running_requests=args.concurrency),
            eos_token_ids=tok.eos_token_ids,
        )
        t0 = time.perf_counter()
        engine.generate(plist, SamplingParams(max_new_tokens=args.max_new_tokens))
        out[f"{domain}/ar"] = {
            "tokens_per_s": round(engine.stats.output_tokens / (time.perf_counter() - t0), 2)
        }
    return out


def run_arm(
    loss: str,
    target_dir: Path,
    target: TargetModel,
    tok: Tokenizer,
    eval_prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"adapt-{loss}-"))
    url = f"sqlite:///{work / 'buffer.db'}"
    db = make_engine(url)
    migrate(db)
    registry = Registry(db, work / "weights")
    registry.register_folder(Path(args.drafter), "v0000", note="shipped chat-only drafter")
    sink = QueueSink(maxsize=100_000)
    writer = BufferWriter(db, sink)
    writer.start()
    engine = Engine(
        target,
        registry.load("v0000", args.dtype),
        EngineConfig(
            policy="head" if loss == "opd" else "fixed",
            max_running_requests=args.concurrency,
            max_batch_tokens=16 * args.concurrency,
        ),
        sink=sink,
        drafter_version="v0000",
        eos_token_ids=tok.eos_token_ids,
    )
    watcher = VersionWatcher(engine, registry, args.dtype, poll_s=1.0)
    log_file = (work / "trainer.log").open("w")  # closed when the arm ends
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.cli",
            "trainer",
            "--database-url",
            url,
            "--weights-dir",
            str(work / "weights"),
            "--target",
            str(target_dir),
            "--min-new",
            str(args.chunk),
            "--loss",
            loss,
            "--epochs",
            str(args.epochs),
            "--anchors",
            str(args.anchors),
            "--threads",
            "1",
            "--poll-s",
            "3",
            "--nice",
            "0",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    math_train = [encode_prompt(tok, p.prompt, chat=True) for p in load_prompts("math", "train")]
    versions = [
        {
            "round": 0,
            "version": "v0000",
            "status": "active",
            **measure(target, registry, "v0000", tok, eval_prompts, args),
        }
    ]
    print(f"[{loss}] v0000 {json.dumps(versions[-1])}", flush=True)
    served = 0
    try:
        for rnd in range(1, args.versions + 1):
            chunk = math_train[served : served + args.chunk]
            served += len(chunk)
            t0 = time.perf_counter()
            engine.generate(chunk, SamplingParams(max_new_tokens=args.max_new_tokens))
            serve_s = time.perf_counter() - t0
            writer.flush(60)
            done = len([r for r in list_runs(db) if r.status in ("succeeded", "failed", "skipped")])
            deadline = time.time() + args.round_timeout_min * 60
            while time.time() < deadline:
                runs = [r for r in list_runs(db) if r.status in ("succeeded", "failed", "skipped")]
                if len(runs) > done:
                    break
                if trainer.poll() is not None:
                    raise RuntimeError(f"trainer exited; see {work / 'trainer.log'}")
                time.sleep(2)
            else:
                raise RuntimeError(f"round {rnd} did not finish in time; see trainer.log")
            run = list_runs(db)[0]
            watcher.check()
            active = registry.active()
            assert active is not None
            newest = registry.list()[-1]
            row = {
                "round": rnd,
                "version": active.id,
                "trained": newest.id,
                "status": newest.status,
                "gate": newest.metrics.get("gate"),
                "train_seconds": run.seconds,
                "samples": run.samples,
                "serve_tokens_per_s": round(engine.stats.output_tokens / max(serve_s, 1e-9), 2)
                if rnd == 1
                else None,
                "final_draft_loss": (newest.metrics.get("train") or {}).get("final_draft_loss"),
                **measure(target, registry, active.id, tok, eval_prompts, args),
            }
            versions.append(row)
            print(f"[{loss}] round {rnd}: {json.dumps(row)}", flush=True)
    finally:
        trainer.terminate()
        trainer.wait(30)
        log_file.close()
        writer.stop(30)
    return {
        "loss": loss,
        "versions": versions,
        "queue_dropped": sink.dropped,
        "swaps": watcher.swapped,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for arm in result["arms"]:
        rounds = [v["round"] for v in arm["versions"]]
        for ax, key, label in (
            (axes[0], "math/fixed", "math τ (fixed k=16)"),
            (axes[1], "chat/fixed", "chat τ (fixed k=16)"),
        ):
            ax.plot(
                rounds,
                [v[key]["accept_len"] for v in arm["versions"]],
                marker="o",
                label=arm["loss"].upper(),
            )
            ax.set_title(label)
        axes[2].plot(
            rounds,
            [v["math/head"]["tokens_per_s"] for v in arm["versions"]],
            marker="o",
            label=f"{arm['loss'].upper()} (head policy)",
        )
    ar = result.get("ar", {}).get("math/ar", {}).get("tokens_per_s")
    if ar:
        axes[2].axhline(ar, color="gray", ls="--", label="plain AR")
    axes[2].set_title("math tokens/s")
    for ax in axes:
        ax.set_xlabel("training round (version)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Online adaptation of the chat-only drafter to math (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--drafter", default=str(REPO / "assets" / "drafters" / DEFAULT_DRAFTER))
    ap.add_argument("--target", default=None)
    ap.add_argument("--arms", nargs="+", default=["opd", "osd"])
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=64, help="math prompts served per round")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--round-timeout-min", type=float, default=40)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="docs/results/adapt")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the other core belongs to the trainer process
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.dtype)
    tok = Tokenizer.from_folder(target_dir)
    eval_prompts = {
        d: [
            encode_prompt(tok, p.prompt, chat=True)
            for p in load_prompts(d, "eval", args.eval_prompts)
        ]
        for d in ("math", "chat")
    }
    result = {
        "benchmark": "bench/demo_adapt.py",
        "args": {**vars(args), "drafter": repo_relative(args.drafter)},
        "machine": {"platform": platform.platform(), "cpu": cpu_info(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ar": measure_ar(target, tok, eval_prompts, args),
        "arms": [],
    }
    print(f"ar {json.dumps(result['ar'])}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for loss in args.arms:
        result["arms"].append(run_arm(loss, target_dir, target, tok, eval_prompts, args))
        (out / "adapt.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "adapt.png")
    print(f"wrote {out / 'adapt.json'} and {out / 'adapt.png'}")


if __name__ == "__main__":
    main()
