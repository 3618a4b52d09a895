"""Does the online trainer's replay window help a drafter learn a new domain, and does training
on the old domains too (``retain``) keep it from forgetting them? Offline, with the real
training round.

For each arm — a ``--replay`` window and a ``--retain`` count, paired in order (one value of
either applies to every arm) — starting from the shipped drafter (chat + code only):

1. a fresh SQLite buffer and weights folder, the shipped drafter registered as ``v0000``;
2. per round, ``--chunk`` new math trajectories (the target's own greedy answers to math train
   prompts, generated once and cached under ``adaflash.pull.cache_dir()``) are written to the
   buffer and one real ``training_round`` runs on them (``OnlineConfig(replay=…, retain=…)``,
   ``--epochs`` passes a round, everything else the trainer's defaults): it trains on the new
   rows plus the replay window plus ``retain`` of the shipped drafter's chat and code train
   trajectories (never the held-out ones), gates and promotes or rejects;
3. after every round the active version's simulated τ (the whole block verified against the
   recorded target tokens, as the gate measures) on held-out math, chat and code trajectories,
   per sequence, so that the arms' difference at each round carries a 95% bootstrap interval
   over the held-out sequences.

Serving is left out on purpose: the question is what the trainer learns from the same data.

    python bench/replay_window.py --out docs/results/adapt/replay --replay 0 192
    python bench/replay_window.py --out … --replay 0 --retain 0 48 96 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from adaflash.cli import DEFAULT_DRAFTER, encode_prompt
from adaflash.config import DistillConfig, EngineConfig, SamplingParams
from adaflash.distill import replay
from adaflash.engine.engine import Engine
from adaflash.engine.records import MemorySink, RequestRecord
from adaflash.hardware import cpu_info
from adaflash.models.drafter import load_drafter
from adaflash.models.target import TargetModel, load_target
from adaflash.paths import REPO, repo_relative, write_text_atomic
from adaflash.pull import cache_dir, resolve_target
from adaflash.teacher_cache import CachedSequence, teach
from adaflash.tokenizer import Tokenizer
from adaflash.workloads import Trajectory, load_prompts
from db.buffer import write_records
from db.registry import Registry
from db.runs import claim_run
from db.session import make_engine, migrate
from lightning_modules.online import OnlineConfig, training_round

EVAL_DOMAINS = ("math", "chat", "code")


def generate(target: TargetModel, tok: Tokenizer, prompts: list[str], domain: str, new: int):
    """The target's greedy answers (policy ``ar``), as the buffer would receive them."""
    sink = MemorySink()
    engine = Engine(
        target,
        None,
        EngineConfig(policy="ar", max_running_requests=16),
        sink=sink,
        eos_token_ids=tok.eos_token_ids,
    )
    engine.generate(
        [encode_prompt(tok, p, chat=True) for p in prompts], SamplingParams(max_new_tokens=new)
    )
    return [replace(r, domain=domain) for r in sink.requests()]


def trajectories(target: TargetModel, tok: Tokenizer, args: argparse.Namespace, path: Path):
    """Math train records (in a seeded order) and held-out records per domain; cached."""
    if path.exists():
        raw = json.loads(path.read_text())
        return (
            [RequestRecord(**r) for r in raw["train"]],
            {d: [RequestRecord(**r) for r in rs] for d, rs in raw["eval"].items()},
        )
    train = [p.prompt for p in load_prompts("math", "train")]
    random.Random(args.seed).shuffle(train)
    records = generate(target, tok, train[: args.chunk * args.rounds], "math", args.max_new_tokens)
    held = {
        d: generate(
            target,
            tok,
            [p.prompt for p in load_prompts(d, "eval", args.eval_prompts)],
            d,
            args.max_new_tokens,
        )
        for d in EVAL_DOMAINS
    }
    raw = {
        "train": [asdict(r) for r in records],
        "eval": {d: [asdict(r) for r in rs] for d, rs in held.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(raw))
    return records, held


def cached(target: TargetModel, layers: tuple[int, ...], records: list[RequestRecord]):
    trajs = [
        Trajectory(r.request_id, r.domain or "", list(r.prompt_ids), list(r.output_ids), "", "")
        for r in records
    ]
    return teach(target, trajs, layers, top_k=0)


def per_sequence(drafter, target, seqs: list[CachedSequence], anchors: int) -> list[list[int]]:
    """[rounds, accepted] per held-out sequence (``replay`` one sequence at a time)."""
    out = []
    for seq in seqs:
        c = replay(drafter, target, [seq], anchors, seed=0)
        out.append([c.rounds, c.accepted])
    return out


def tau(counts: list[list[int]]) -> float:
    rounds = sum(r for r, _ in counts)
    return (rounds + sum(a for _, a in counts)) / rounds if rounds else 0.0


def bootstrap_diff(a: list[list[int]], b: list[list[int]], draws: int = 2000) -> list[float]:
    """τ(a) − τ(b) and its 95% interval, resampling held-out sequences (paired)."""
    rng = random.Random(0)
    n = len(a)
    diffs = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        diffs.append(tau([a[i] for i in idx]) - tau([b[i] for i in idx]))
    diffs.sort()
    return [round(tau(a) - tau(b), 4), round(diffs[draws // 40], 4), round(diffs[-draws // 40], 4)]


def run_arm(window: int, retain: int, target, records, seqs, args: argparse.Namespace) -> dict:
    """One arm; ``seqs``: the held-out sequences per domain, taught once for every arm."""
    work = Path(tempfile.mkdtemp(prefix=f"replay-{window}-{retain}-"))
    db = make_engine(f"sqlite:///{work / 'buffer.db'}")
    migrate(db)
    registry = Registry(db, work / "weights")
    registry.register_folder(Path(args.drafter), "v0000", note="shipped chat + code drafter")
    cfg = OnlineConfig(
        min_new=args.chunk,
        max_samples=args.chunk,
        replay=window,
        retain=retain,
        distill=DistillConfig(epochs=args.epochs),
    )

    def measure() -> dict:
        drafter = registry.load(registry.active().id)
        return {d: per_sequence(drafter, target, s, args.anchors) for d, s in seqs.items()}

    rounds = [{"round": 0, "version": "v0000", "counts": measure()}]
    for i in range(args.rounds):
        write_records(db, records[i * args.chunk : (i + 1) * args.chunk])
        t0 = time.perf_counter()
        out = training_round(db, registry, target, cfg, claim_run(db, "admin"))
        row = {
            "round": i + 1,
            "trained": out.version_id,
            "promoted": out.promoted,
            "status": out.status,
            "reason": out.reason,
            "gate": out.metrics.get("gate"),
            "replayed": out.metrics.get("replayed"),
            "retained": out.metrics.get("retained"),
            "train_seconds": round(time.perf_counter() - t0, 1),
            "version": registry.active().id,
            "counts": measure(),
        }
        rounds.append(row)
        print(f"{arm_name(window, retain)} round {i + 1}: {brief(row)}", flush=True)
    return {"replay": window, "retain": retain, "rounds": rounds}


def arm_name(window: int, retain: int) -> str:
    """``replay_W``, and ``_retain_K`` where the arm retains (the names of runs before it kept)."""
    return f"replay_{window}" + (f"_retain_{retain}" if retain else "")


def arm_of(arm: dict) -> str:
    return arm_name(arm["replay"], arm.get("retain", 0))


def paired(windows: list[int], retains: list[int]) -> list[tuple[int, int]]:
    """The arms: ``--replay`` and ``--retain`` in order, a single value of either for every arm."""
    if len(windows) == 1:
        windows = windows * len(retains)
    if len(retains) == 1:
        retains = retains * len(windows)
    if len(windows) != len(retains):
        raise SystemExit("--replay and --retain pair up: give each one value or the same count")
    return list(zip(windows, retains, strict=True))


def brief(row: dict) -> str:
    taus = " ".join(f"{d} τ {tau(c):.3f}" for d, c in row["counts"].items())
    return f"{row['version']} ({'promoted' if row['promoted'] else row['status']}) {taus}"


def summarize(arms: list[dict]) -> dict:
    """τ per arm, round and domain; each arm against the first arm, with 95% intervals."""
    base = arms[0]
    out = {}
    for arm in arms:
        rows = []
        for r, b in zip(arm["rounds"], base["rounds"], strict=True):
            row = {"round": r["round"], "version": r["version"]}
            for d, counts in r["counts"].items():
                row[f"{d}_tau"] = round(tau(counts), 4)
                if arm is not base:
                    diff = bootstrap_diff(counts, b["counts"][d])
                    row[f"{d}_minus_{arm_of(base)}"] = diff
            rows.append(row)
        out[arm_of(arm)] = rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default=str(REPO / "assets" / "drafters" / DEFAULT_DRAFTER))
    ap.add_argument("--target", default=None)
    ap.add_argument("--replay", type=int, nargs="+", default=[0, 192], help="the arms' windows")
    ap.add_argument(
        "--retain", type=int, nargs="+", default=[0], help="the arms' old-domain trajectories"
    )
    ap.add_argument("--epochs", type=int, default=DistillConfig().epochs, help="passes a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=96, help="new math trajectories per round")
    ap.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--anchors", type=int, default=64, help="anchors per held-out sequence")
    ap.add_argument("--seed", type=int, default=0, help="the order of the math train prompts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="docs/results/adapt/replay")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, "bfloat16")
    tok = Tokenizer.from_folder(target_dir)
    t0 = time.perf_counter()
    key = f"math{args.chunk * args.rounds}-seed{args.seed}-eval{args.eval_prompts}"
    key += f"-new{args.max_new_tokens}"
    cache = cache_dir() / "bench" / f"replay-trajectories-{key}.json"
    records, held = trajectories(target, tok, args, cache)
    print(f"{len(records)} math train trajectories, held out {', '.join(held)}", flush=True)
    layers = load_drafter(Path(args.drafter)).cfg.target_layer_ids
    seqs = {d: cached(target, layers, rs) for d, rs in held.items()}
    arms = [run_arm(w, k, target, records, seqs, args) for w, k in paired(args.replay, args.retain)]
    result = {
        "benchmark": "bench/replay_window.py",
        "args": {**vars(args), "drafter": repo_relative(args.drafter)},
        "machine": {"platform": platform.platform(), "cpu": cpu_info(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "summary": summarize(arms),
        "arms": arms,
    }
    write_text_atomic(out / "replay.json", json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
