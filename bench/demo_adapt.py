"""Online adaptation proof: a drafter that never saw math learns it while serving (paper Fig. 2a,
Table 2). For each arm (OPD = AdaFlash's loss, OSD = forward-KL baseline) and each repeat:

1. a fresh SQLite buffer and weights folder; the shipped drafter (chat + code only) registered
   as ``v0000``;
2. the engine serves math train prompts in chunks of ``--chunk`` (greedy, concurrency
   ``--concurrency``, the ``head`` policy for OPD as AdaFlash serves, ``fixed`` for OSD as
   DFlash/OSD serve); its records flow through the bounded queue and the writer into the buffer.
   Each repeat serves the prompts in its own seeded order, and its trainer trains with its seed;
3. a real ``adaflash trainer`` process (own process, 1 thread) trains when ``--chunk`` new
   trajectories exist, publishes a version, gates it, and promotes or rejects it;
4. the engine hot-swaps each promoted version (``VersionWatcher``) between steps;
5. after every round, the serving drafter is measured on held-out eval prompts: τ with the
   ``fixed`` policy on math, chat and code (drafter quality; chat and code show forgetting), and
   on math tokens/s with the default ``cost`` policy over plain decoding's, the two serving
   side by side a step each in turn (``compare.run_lockstep``; until 2026-12-07 one right
   after the other), at ``--concurrency`` and at one request, and τ / tokens/s with the
   ``head`` policy twice — the version's own (refitted) length head, and the head frozen at
   ``v0000``'s offline fit on the same drafter (the paper's Table 2 point).

Every engine runs the compiled decode and verify steps ``serve`` runs (built before anything is
timed; ``--no-compile``: eager). Serving and training are serialized here (serve a chunk, then
wait for the round) so the per-version numbers are not disturbed by the trainer sharing the two
CPU cores; ``adaflash serve`` runs them concurrently (``adaflash demo`` shows that live).
Per-prompt τ is kept, so the summary gives OPD − OSD at the last version with a 95% bootstrap
interval over (repeat, prompt) units, and each arm's math gain and chat / code change against
``v0000``. Writes ``adapt.json`` and ``adapt.png`` under ``--out``.

    python bench/demo_adapt.py --out docs/results/adapt           # hours on two CPU cores
    python bench/demo_adapt.py --quick --out /tmp/adapt-smoke     # the pipeline, minutes
    python bench/demo_adapt.py --out docs/results/adapt --resume  # on from the finished arms
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for compare
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo

from compare import run_lockstep  # bench/ is a folder of scripts, not a package

from adaflash.cli import DEFAULT_DRAFTER, encode_prompt
from adaflash.config import EngineConfig, SamplingParams
from adaflash.engine.engine import Engine
from adaflash.engine.records import QueueSink
from adaflash.hardware import cpu_info
from adaflash.metrics import SpecCounters, speedup
from adaflash.models.decode_graph import batch_sizes, compile_now
from adaflash.models.drafter import DFlashDrafter, load_drafter
from adaflash.models.length_head import LengthHead
from adaflash.models.target import TargetModel, load_target
from adaflash.paths import REPO, repo_relative, write_text_atomic
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import load_prompts
from app.demo import TRAINING
from app.training.hotswap import VersionWatcher
from db.buffer import BufferWriter
from db.registry import Registry
from db.runs import list_runs
from db.session import make_engine, migrate
from lightning_modules.online import OnlineConfig

EVAL_DOMAINS = ("math", "chat", "code")


def policy_engine(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    version: str,
    policy: str,
    tok: Tokenizer,
    args: argparse.Namespace,
    concurrency: int,
) -> Engine:
    """An engine for one eval pass (``ar`` where there is no drafter)."""
    return Engine(
        target,
        drafter,
        EngineConfig(
            policy=policy if drafter is not None else "ar",
            max_running_requests=concurrency,
            max_batch_tokens=16 * concurrency,
            compile=args.compile,
        ),
        drafter_version=version,
        eos_token_ids=tok.eos_token_ids,
    )


def run_policy(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    version: str,
    policy: str,
    prompts: list[list[int]],
    tok: Tokenizer,
    args: argparse.Namespace,
    concurrency: int,
) -> dict:
    """One eval pass at ``concurrency``: τ overall and per prompt, verify length, tokens/s."""
    engine = policy_engine(target, drafter, version, policy, tok, args, concurrency)
    t0 = time.perf_counter()
    records = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
    wall = time.perf_counter() - t0
    c, st = engine.counters, engine.stats
    return {
        "accept_len": round(c.accept_len, 4),
        "verify_len": round(c.verify_len, 4),
        "tokens_per_s": round(st.output_tokens / wall, 2),
        # τ of each prompt: the unit the bootstrap resamples
        "per_prompt": [round((r.accepted + r.rounds) / max(r.rounds, 1), 4) for r in records],
    } | (cost_figures(engine) if policy == "cost" else {})


def cost_against_ar(
    target: TargetModel,
    drafter: DFlashDrafter,
    version: str,
    prompts: list[list[int]],
    tok: Tokenizer,
    args: argparse.Namespace,
    concurrency: int,
) -> tuple[dict, dict]:
    """The default policy's pass and plain decoding's on the same prompts, side by side a step
    each in turn, each timed on its own steps (``compare.run_lockstep``): a slow spell of the
    machine lands on both alike. (Until 2026-12-07 one ran right after the other.)"""
    engines = {
        (version, "cost"): policy_engine(target, drafter, version, "cost", tok, args, concurrency),
        (None, "ar"): policy_engine(target, None, version, "ar", tok, args, concurrency),
    }
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    runs = {
        key: {
            "accept_len": round(run["accept_len"], 4),
            "verify_len": round(run["verify_len"], 4),
            "tokens_per_s": round(run["tokens_per_s"], 2),
        }
        for key, run in run_lockstep(engines, prompts, params).items()
    }
    return runs[version, "cost"] | cost_figures(engines[version, "cost"]), runs[None, "ar"]


def cost_figures(engine: Engine) -> dict:
    """What a ``cost`` engine decided from: its probes' whole-block τ and its prices."""
    st = engine.stats
    probed = SpecCounters.from_totals(
        engine.block_size, st.probes, st.probe_slots, st.probe_accepted
    )  # each probe the round it stands for (``adaflash.metrics.probe_buckets``)
    prices = engine.cost.snapshot()
    return {
        "probes": st.probes,
        "probed_tau": round(probed.accept_len, 4) if st.probes else None,
        "cost_model_ms": {
            k: round(v, 3)
            for k, v in prices.items()
            if k.startswith(("drafter_", "target_1req_", "target_plain_"))
        },
    }


def measure(
    target: TargetModel,
    registry: Registry,
    version: str,
    frozen: LengthHead,
    tok: Tokenizer,
    prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> dict:
    """A version on the eval prompts: fixed-policy τ per domain; on math also the default
    policy's tokens/s beside plain decoding's, side by side (at ``--concurrency``
    and at 1: on a CPU a verify pass costs more the more tokens are in it, so speculation pays
    first at low concurrency), and the head policy with the version's head and with ``frozen``
    (v0000's, as fitted offline)."""
    drafter = registry.load(version, args.dtype)
    c = args.concurrency
    out = {
        f"{d}/fixed": run_policy(target, drafter, version, "fixed", prompts[d], tok, args, c)
        for d in EVAL_DOMAINS
    }
    math = prompts["math"]
    for n, tag in ((c, ""), (1, "@1")):
        cost, ar = cost_against_ar(target, drafter, version, math, tok, args, n)
        out[f"math/cost{tag}"], out[f"math/ar{tag}"] = cost, ar
    out["math/head"] = run_policy(target, drafter, version, "head", math, tok, args, c)
    drafter.length_head = frozen  # the same drafter, the head as fitted offline
    out["math/head-frozen"] = run_policy(target, drafter, version, "head", math, tok, args, c)
    return out


def run_arm(
    loss: str,
    repeat: int,
    target_dir: Path,
    target: TargetModel,
    tok: Tokenizer,
    eval_prompts: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"adapt-{loss}-{repeat}-"))
    url = f"sqlite:///{work / 'buffer.db'}"
    db = make_engine(url)
    migrate(db)
    registry = Registry(db, work / "weights")
    registry.register_folder(Path(args.drafter), "v0000", note="shipped chat + code drafter")
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
            compile=args.compile,
        ),
        sink=sink,
        drafter_version="v0000",
        eos_token_ids=tok.eos_token_ids,
    )
    frozen = registry.load("v0000", args.dtype).length_head  # Table 2's frozen head
    watcher = VersionWatcher(engine, registry, args.dtype, poll_s=1.0)
    log_file = (work / "trainer.log").open("w")  # closed when the arm ends
    trainer_cmd = [sys.executable, "-m", "app.cli", "trainer", "--database-url", url]
    trainer_cmd += ["--weights-dir", str(work / "weights"), "--target", str(target_dir)]
    trainer_cmd += ["--min-new", str(args.chunk), "--loss", loss, "--epochs", str(args.epochs)]
    trainer_cmd += ["--anchors", str(args.anchors), "--seed", str(repeat), "--threads", "1"]
    trainer_cmd += ["--poll-s", "3", "--nice", "0", "--replay", str(args.replay)]
    trainer_cmd += ["--retain", str(args.retain)]
    trainer = subprocess.Popen(
        trainer_cmd,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    math_train = [encode_prompt(tok, p.prompt, chat=True) for p in load_prompts("math", "train")]
    random.Random(repeat).shuffle(math_train)  # each repeat its own order of the train prompts
    versions = [
        {
            "round": 0,
            "version": "v0000",
            "status": "active",
            **measure(target, registry, "v0000", frozen, tok, eval_prompts, args),
        }
    ]
    print(f"[{loss} #{repeat}] v0000 {brief(versions[-1])}", flush=True)
    served = 0
    try:
        for rnd in range(1, args.versions + 1):
            chunk = math_train[served : served + args.chunk]
            served += len(chunk)
            engine.generate(chunk, SamplingParams(max_new_tokens=args.max_new_tokens))
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
                "final_draft_loss": (newest.metrics.get("train") or {}).get("final_draft_loss"),
                **measure(target, registry, active.id, frozen, tok, eval_prompts, args),
            }
            versions.append(row)
            print(f"[{loss} #{repeat}] round {rnd}: {brief(row)}", flush=True)
    finally:
        trainer.terminate()
        trainer.wait(30)
        log_file.close()
        writer.stop(30)
    return {
        "loss": loss,
        "repeat": repeat,
        "versions": versions,
        "queue_dropped": sink.dropped,
        "swaps": watcher.swapped,
    }


def brief(row: dict) -> str:
    cells = [f"{k.split('/')[0]} τ {row[k]['accept_len']:.3f}" for k in row if k.endswith("/fixed")]
    cells += [
        f"{k} {row[k]['tokens_per_s']:.1f} tok/s τ {row[k]['accept_len']:.3f}"
        for k in ("math/cost", "math/cost@1", "math/head", "math/head-frozen")
    ]
    cells += [f"cost/ar {cost_over_ar(row, tag):.3f}" for tag in ("", "@1")]
    return f"{row['version']} ({row['status']}): " + ", ".join(cells)


def cost_over_ar(row: dict, tag: str = "") -> float:
    """The default policy's speedup over plain decoding measured beside it (``tag`` "" at
    ``--concurrency``, "@1" at one request)."""
    return speedup(row[f"math/cost{tag}"]["tokens_per_s"], row[f"math/ar{tag}"]["tokens_per_s"])


def promoted_worse(versions: list[dict]) -> list[dict]:
    """Rounds whose promoted version measured a lower math τ on the eval prompts than the
    version it replaced (the gate decides on its own held-out rows; this checks it on others)."""
    worse = []
    for before, row in itertools.pairwise(versions):
        if row["version"] != before["version"]:
            tau = [[v["math/fixed"]["per_prompt"]] for v in (row, before)]
            diff = bootstrap(*tau)
            if diff[0] < 0:
                worse.append({"round": row["round"], "version": row["version"], "tau_diff": diff})
    return worse


def bootstrap(
    a: list[list[float]], b: list[list[float]] | None = None, n: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of ``a`` (minus mean of ``b``) and its 95% interval, resampling repeats and then
    prompts within each repeat (the two levels of noise: training seed and eval prompt)."""

    def mean(groups: list[list[float]]) -> float:
        flat = [x for g in groups for x in g]
        return sum(flat) / len(flat)

    def draw(groups: list[list[float]], rng: random.Random) -> list[list[float]]:
        picked = [groups[rng.randrange(len(groups))] for _ in groups]
        return [[g[rng.randrange(len(g))] for _ in g] for g in picked]

    rng = random.Random(seed)
    point = mean(a) - (mean(b) if b else 0.0)
    stats = sorted(mean(draw(a, rng)) - (mean(draw(b, rng)) if b else 0.0) for _ in range(n))
    return round(point, 4), round(stats[int(0.025 * n)], 4), round(stats[int(0.975 * n) - 1], 4)


def summarize(arms: list[dict]) -> dict:
    """Per arm: math τ gain and chat / code change at the last version vs v0000 (relative, with
    intervals); OPD − OSD on math τ at the last version; head refitted vs frozen."""
    out: dict = {}
    by_loss: dict[str, list[dict]] = {}
    for arm in arms:
        by_loss.setdefault(arm["loss"], []).append(arm)
    for loss, runs in by_loss.items():
        first = [r["versions"][0] for r in runs]
        last = [r["versions"][-1] for r in runs]
        row: dict = {"repeats": len(runs), "versions": len(runs[0]["versions"]) - 1}
        for d in EVAL_DOMAINS:
            key = f"{d}/fixed"
            base = sum(v[key]["accept_len"] for v in first) / len(first)
            before = [v[key]["per_prompt"] for v in first]
            diff = bootstrap([v[key]["per_prompt"] for v in last], before)
            row[f"{d}_tau_v0"] = round(base, 4)  # τ pooled over each pass's rounds
            row[f"{d}_tau_last"] = round(sum(v[key]["accept_len"] for v in last) / len(last), 4)
            # the mean of per-prompt τ (the bootstrap's unit) moved by this share, 95% interval
            per_prompt_base = sum(map(sum, before)) / sum(map(len, before))
            row[f"{d}_tau_change"] = [round(x / per_prompt_base, 4) for x in diff]
        for key in ("math/cost", "math/ar", "math/cost@1", "math/ar@1"):
            row[f"{key}_tokens_per_s"] = [
                [v[key]["tokens_per_s"] for v in r["versions"]] for r in runs
            ]
        for tag in ("", "@1"):  # per repeat, per version
            row[f"math/cost_over_ar{tag}"] = [
                [round(cost_over_ar(v, tag), 3) for v in r["versions"]] for r in runs
            ]
        row["promoted_worse_on_eval"] = [promoted_worse(r["versions"]) for r in runs]
        row["head_refit_minus_frozen_tau"] = bootstrap(
            [v["math/head"]["per_prompt"] for v in last],
            [v["math/head-frozen"]["per_prompt"] for v in last],
        )
        out[loss] = row
    if "opd" in by_loss and "osd" in by_loss:
        out["opd_minus_osd_math_tau"] = bootstrap(
            [r["versions"][-1]["math/fixed"]["per_prompt"] for r in by_loss["opd"]],
            [r["versions"][-1]["math/fixed"]["per_prompt"] for r in by_loss["osd"]],
        )
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    colors = {"opd": "#2e7d32", "osd": "#1565c0"}
    for arm in result["arms"]:
        rounds = [v["round"] for v in arm["versions"]]
        label = f"{arm['loss'].upper()} #{arm['repeat']}"
        style = {"color": colors.get(arm["loss"]), "marker": "o", "alpha": 0.8}
        for ax, domain in zip(axes[:3], EVAL_DOMAINS, strict=True):
            ax.plot(
                rounds,
                [v[f"{domain}/fixed"]["accept_len"] for v in arm["versions"]],
                label=label,
                **style,
            )
            ax.set_title(f"{domain} τ (fixed k)")
        for tag, ls in (("", "-"), ("@1", ":")):
            axes[3].plot(
                rounds,
                [cost_over_ar(v, tag) for v in arm["versions"]],
                label=f"{label}, {tag[1:] or result['args']['concurrency']} request(s)",
                **style,
                ls=ls,
            )
    axes[3].axhline(1.0, color="gray", ls="--", label="plain AR")
    axes[3].set_title("math tokens/s, default policy ÷ plain AR")
    for ax in axes:
        ax.set_xlabel("training round (version)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Online adaptation of the chat + code drafter to math (SmolLM2-135M, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


RUN_ARGS = (  # what makes arms comparable
    *("drafter", "target", "versions", "chunk", "epochs", "anchors", "eval_prompts"),
    *("concurrency", "max_new_tokens", "dtype", "replay", "retain", "compile"),
)


def resumed(path: Path, fresh: dict) -> dict:
    """The earlier result at ``path`` to go on from, if it ran with the same settings (its arms
    kept; each arm names the machine and date it ran on, and measured plain decoding beside
    itself), else ``fresh``. A run takes hours on two cores: a session may end before it does."""
    if not path.is_file():
        return fresh
    old = json.loads(path.read_text())
    differ = [k for k in RUN_ARGS if old["args"].get(k) != fresh["args"].get(k)]
    if differ:
        raise SystemExit(f"{path} ran with other settings ({', '.join(differ)}): not resuming")
    print(f"resuming {path}: {len(old['arms'])} arm(s) kept", flush=True)
    return {**fresh, "arms": old["arms"], "date": old["date"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--drafter", default=str(REPO / "assets" / "drafters" / DEFAULT_DRAFTER))
    ap.add_argument("--target", default=None)
    ap.add_argument("--arms", nargs="+", default=["opd", "osd"])
    ap.add_argument("--repeats", type=int, default=2, help="seeds per arm (own prompt order)")
    ap.add_argument("--versions", type=int, default=5)
    # the training defaults are adaflash demo's server's (app/demo.py TRAINING)
    ap.add_argument(
        "--chunk", type=int, default=TRAINING.min_new, help="math prompts a round (%(default)s)"
    )
    ap.add_argument(
        "--epochs", type=int, default=TRAINING.epochs, help="passes over a round (%(default)s)"
    )
    ap.add_argument(
        "--replay",
        type=int,
        default=OnlineConfig().replay,
        help="the trainer's replay window (trajectories of earlier rounds trained on again)",
    )
    ap.add_argument(
        "--retain",
        type=int,
        default=TRAINING.retain,
        help="the trainer's chat and code trajectories a round (the shipped drafter's domains; "
        "%(default)s; 0: none)",
    )
    ap.add_argument(
        "--anchors", type=int, default=TRAINING.anchors, help="anchors a sequence (%(default)s)"
    )
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--round-timeout-min", type=float, default=40)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="eager steps (serve compiles them: tokens/s then is not serve's)",
    )
    ap.add_argument("--quick", action="store_true", help="1 repeat, 1 version, 2 eval prompts")
    ap.add_argument("--out", default="docs/results/adapt")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the arms already in --out/adapt.json (same settings) and run the rest",
    )
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.versions, args.eval_prompts, args.max_new_tokens = 1, 1, 2, 32
    supply = len(load_prompts("math", "train"))
    if args.versions * args.chunk > supply:  # else the last rounds would wait out their timeout
        raise SystemExit(
            f"--versions {args.versions} × --chunk {args.chunk} needs "
            f"{args.versions * args.chunk} math train prompts; there are {supply}"
        )
    torch.set_num_threads(1)  # the other core belongs to the trainer process
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.dtype)
    tok = Tokenizer.from_folder(target_dir)
    eval_prompts = {
        d: [
            encode_prompt(tok, p.prompt, chat=True)
            for p in load_prompts(d, "eval", args.eval_prompts)
        ]
        for d in EVAL_DOMAINS
    }
    result = {
        "benchmark": "bench/demo_adapt.py",
        "args": {**vars(args), "drafter": repo_relative(args.drafter)},
        "machine": {"platform": platform.platform(), "cpu": cpu_info(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "compile_s": {},
        "arms": [],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        result = resumed(out / "adapt.json", result)
    done = {(a["loss"], a["repeat"]) for a in result["arms"]}
    # arms interleaved: a slow phase hits both
    todo = [(loss, r) for r in range(args.repeats) for loss in args.arms if (loss, r) not in done]
    if todo and args.compile:  # the graphs `serve` compiles in the background, built here first
        shipped = load_drafter(Path(args.drafter), "float32")
        capture = tuple(shipped.cfg.target_layer_ids)
        batches = batch_sizes(args.concurrency)
        result["compile_s"] = compile_now(target, [(), capture], batches, shipped)
    for loss, repeat in todo:
        arm = run_arm(loss, repeat, target_dir, target, tok, eval_prompts, args)
        arm |= {"machine": result["machine"], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        result["arms"].append(arm)
        result["summary"] = summarize(result["arms"])
        # replaced whole: a run killed mid-write keeps the last arm's file
        write_text_atomic(out / "adapt.json", json.dumps(result, indent=1) + "\n")
    if not todo:  # a resumed run with nothing left: its kept arms summarized
        result["summary"] = summarize(result["arms"])
    plot(result, out / "adapt.png")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out / 'adapt.json'} and {out / 'adapt.png'}")


if __name__ == "__main__":
    main()
