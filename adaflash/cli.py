"""The pure ``adaflash`` sub-commands (generate, pull, regenerate), one plain function each.

The full command line, with training, the trainer and the server, is ``app.cli`` (the
``adaflash`` entry point); it adds its sub-commands to these.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from adaflash.config import POLICIES, EngineConfig, SamplingParams
from adaflash.engine.detokenize import TextStreamer
from adaflash.engine.engine import Engine
from adaflash.engine.records import RequestRecord
from adaflash.engine.request import TokenEvent
from adaflash.models.drafter import load_drafter
from adaflash.models.target import load_target
from adaflash.pull import PullError
from adaflash.tokenizer import Tokenizer

DEFAULT_DRAFTER = "smollm2-135m-dflash"


def build_engine(
    target_dir: str | Path, drafter_dir: str | Path | None, cfg: EngineConfig, **engine_kwargs: Any
) -> tuple[Engine, Tokenizer]:
    """Load target (+ tokenizer) and drafter from folders and assemble an engine."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    target = load_target(target_dir, cfg.dtype)
    tok = Tokenizer.from_folder(target_dir)
    drafter = load_drafter(drafter_dir, cfg.dtype) if drafter_dir else None
    eos = tuple(sorted(set(target.cfg.eos_token_ids) | set(tok.eos_token_ids)))
    engine = Engine(
        target,
        drafter,
        cfg,
        detokenize=tok.decode,
        eos_token_ids=eos,
        drafter_version=str(drafter_dir) if drafter_dir else "none",
        **engine_kwargs,
    )
    return engine, tok


def encode_prompt(tok: Tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    if chat and tok.has_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}
        ]
        return tok.chat(messages)
    return tok.encode(text)


def default_drafter() -> Path | None:
    """The drafter shipped in the repository for the default target, when present."""
    path = Path(__file__).resolve().parent.parent / "assets" / "drafters" / DEFAULT_DRAFTER
    return path if (path / "config.json").is_file() else None


def resolve_drafter(spec: str | None, target_spec: str | None) -> str | None:
    """``none`` → no drafter; a folder → itself; unset → the shipped default drafter when the
    target is the default one."""
    from adaflash.pull import DEFAULT_TARGET

    if spec == "none":
        return None
    if spec:
        return spec
    if target_spec in (None, DEFAULT_TARGET):
        found = default_drafter()
        return str(found) if found else None
    return None


def cmd_generate(args: argparse.Namespace) -> int:
    from adaflash.pull import resolve_target

    drafter = resolve_drafter(args.drafter, args.target)
    cfg = EngineConfig(
        policy=args.policy or ("cost" if drafter else "ar"),
        gamma=args.gamma,
        dtype=args.dtype,
        num_threads=args.threads,
    )
    target = resolve_target(args.target, progress=lambda m: print(m, file=sys.stderr))
    engine, tok = build_engine(target, drafter, cfg)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    prompts = [encode_prompt(tok, p, not args.raw) for p in args.prompt]
    streamers = {}

    def printer(i: int) -> Callable[[TokenEvent], None]:
        streamers[i] = TextStreamer(tok.decode, params.stop)

        def on_event(ev: TokenEvent) -> None:
            sys.stdout.write(streamers[i].push(ev.token_ids, final=ev.finished))
            sys.stdout.flush()

        return on_event

    t0 = time.perf_counter()
    if len(prompts) == 1 and not args.json:
        engine.add_request(prompts[0], params, on_event=printer(0))
        while engine.has_work:
            engine.step()
        print()
        records = []
    else:
        records = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    stats = {
        "policy": engine.policy,
        "output_tokens": engine.stats.output_tokens,
        "tokens_per_s": round(engine.stats.output_tokens / elapsed, 2),
        "draft_ms_per_step": round(1e3 * engine.stats.draft_s / max(engine.stats.steps, 1), 2),
        "verify_ms_per_step": round(1e3 * engine.stats.verify_s / max(engine.stats.steps, 1), 2),
        **engine.counters.summary(),
    }
    if args.json:
        print(json.dumps({"outputs": [r.output_text for r in records], "stats": stats}, indent=2))
    else:
        for i, r in enumerate(records):
            print(f"--- [{i}] {r.output_text}")
        print(
            "--- " + "  ".join(f"{k}={v}" for k, v in stats.items() if k != "slot_acceptance"),
            file=sys.stderr,
        )
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from adaflash.pull import pull

    print(pull(args.name, force=args.force))
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    """Let the target answer prompts (batched); append trajectories (resumable by id).

    Prompts come from a shipped workload (``--domain``/``--split``) or any JSONL file
    (``--prompts``). ``--temperature`` samples instead of greedy (ids get ``@T…s<seed>``);
    ``--follow-up`` answers a second user turn after each first-turn trajectory of a file."""
    from tqdm import tqdm

    from adaflash.pull import resolve_target
    from adaflash.workloads import (
        Prompt,
        Trajectory,
        follow_up,
        load_prompts,
        read_prompt_file,
        read_trajectories,
    )

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.is_file():
        done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.strip()}
    if args.prompts:
        prompts = read_prompt_file(args.prompts, args.domain)
    elif args.domain:
        prompts = load_prompts(args.domain, args.split)
    else:
        raise ValueError("give --domain (a shipped workload) or --prompts FILE")
    sampled = args.temperature > 0
    suffix = f"@T{args.temperature:g}s{args.seed}" if sampled else ""
    first_turns = (
        {t.id: t for t in read_trajectories(Path(args.follow_up))} if args.follow_up else {}
    )
    if args.follow_up:
        prompts = [p for p in prompts if p.id + suffix in first_turns]
        suffix += "+fu"
    prompts = prompts[: args.limit] if args.limit else prompts
    todo = [p for p in prompts if p.id + suffix not in done]
    if not todo:
        print(f"{out}: all {len(done)} prompts already answered")
        return 0
    cfg = EngineConfig(
        policy=args.policy or ("cost" if args.drafter else "ar"),
        dtype=args.dtype,
        num_threads=args.threads,
        max_running_requests=args.batch,
        max_batch_tokens=max(512, args.batch * 16),
        compile=args.compile,
    )
    engine, tok = build_engine(resolve_target(args.target), args.drafter, cfg)

    def prompt_ids(p: Prompt) -> list[int]:
        if not args.follow_up:
            return encode_prompt(tok, p.prompt, chat=True)
        first = first_turns[p.id + suffix.removesuffix("+fu")]
        return tok.chat(
            [
                {"role": "user", "content": p.prompt},
                {"role": "assistant", "content": first.response},
                {"role": "user", "content": follow_up(first.id)},
            ]
        )

    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc=out.name, unit="prompt")
    with out.open("a", encoding="utf-8") as f:
        for i, p in enumerate(todo):
            ids = prompt_ids(p)
            params = SamplingParams(
                temperature=args.temperature,
                top_p=args.top_p,
                max_new_tokens=args.max_new_tokens,
                seed=args.seed * 1_000_003 + i if sampled else None,
            )

            def write(rec: RequestRecord, p: Prompt = p, ids: list[int] = ids) -> None:
                traj = Trajectory(
                    p.id + suffix,
                    p.domain,
                    ids,
                    list(rec.output_ids),
                    rec.output_text or "",
                    rec.finish_reason,
                )
                f.write(traj.to_json() + "\n")
                f.flush()
                bar.update(1)

            engine.add_request(
                ids, params, request_id=p.id + suffix, domain=p.domain, on_finish=write
            )
        while engine.has_work:
            engine.step()
    bar.close()
    print(f"{out}: {len(prompts)} trajectories; {engine.stats.output_tokens} new tokens")
    return 0


def cmd_drafter_data(args: argparse.Namespace) -> int:
    """Shards of self-written prompts and the target's greedy answers (resumable; see
    ``adaflash/datagen/job.py``)."""
    from adaflash.datagen.card import write_card
    from adaflash.datagen.job import DataJob, DataJobConfig, shard_paths
    from adaflash.pull import resolve_target

    if args.card:
        print(write_card(Path(args.out)))
        return 0

    cfg = DataJobConfig(
        out=Path(args.out),
        work=Path(args.work),
        seed=args.seed,
        shards=args.shards,
        first_shard=args.first_shard,
        prompts_per_shard=args.prompts_per_shard,
    )
    if args.magpie_only:
        cfg = cfg.magpie_only()
    engine_cfg = EngineConfig(
        policy="ar",
        dtype=args.dtype,
        num_threads=args.threads,
        max_running_requests=args.batch,
        max_batch_tokens=max(512, args.batch * 16),
        compile=args.compile,
    )
    engine, tok = build_engine(resolve_target(args.target), None, engine_cfg)
    job = DataJob(cfg, engine, tok, log=lambda m: print(time.strftime("%H:%M:%S"), m, flush=True))
    made = job.run()
    print(f"{len(made)} new shards; {len(shard_paths(cfg.out, cfg.seed))} in {cfg.out}")
    print(f"data card: {write_card(cfg.out)}")
    return 0


def _add_drafter_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drafter-data",
        help="self-written prompts (Magpie) + standard-library tasks and the target's greedy "
        "answers, in resumable gzip shards (drafter-training data)",
    )
    p.add_argument("--out", default="assets/drafter_data", help="sealed shards")
    p.add_argument("--work", default="data/drafter_data_work", help="unfinished shards' stages")
    p.add_argument("--seed", type=int, default=0, help="namespace: 0 training, 1 held-out")
    p.add_argument("--shards", type=int, default=100, help="make shards [--first-shard, this)")
    p.add_argument("--first-shard", type=int, default=0)
    p.add_argument("--prompts-per-shard", type=int, default=512)
    p.add_argument("--magpie-only", action="store_true", help="no standard-library tasks")
    p.add_argument("--target", default=None, help="model folder or name (default: smollm2)")
    p.add_argument("--batch", type=int, default=32, help="concurrent requests")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (a background job: 1)")
    p.add_argument("--compile", action="store_true", help="compiled batched decode steps")
    p.add_argument("--card", action="store_true", help="only (re)write the data card")
    p.set_defaults(func=cmd_drafter_data)


def _add_pull(sub: argparse._SubParsersAction) -> None:
    from adaflash.pull import DEFAULT_MODELS, DEFAULT_TARGET

    p = sub.add_parser("pull", help="fetch a default model into the cache (idempotent)")
    p.add_argument("name", nargs="?", default=DEFAULT_TARGET, choices=sorted(DEFAULT_MODELS))
    p.add_argument("--force", action="store_true", help="fetch and convert again")
    p.set_defaults(func=cmd_pull)


def _add_regenerate(sub: argparse._SubParsersAction) -> None:
    from adaflash.workloads import DOMAINS, SPLITS

    p = sub.add_parser(
        "regenerate",
        help="the target answers workload prompts; writes "
        "trajectories (prompt, response, domain) as JSONL",
    )
    p.add_argument("--domain", choices=DOMAINS, default=None, help="a shipped workload")
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--prompts", default=None, help="any JSONL file with a 'prompt' per line")
    p.add_argument("--out", required=True, help="trajectory JSONL (appended; reruns resume)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of a sampled variant")
    p.add_argument(
        "--follow-up",
        default=None,
        help="first-turn trajectory file: answer a follow-up question after each",
    )
    p.add_argument("--target", default=None, help="model folder or name (default: smollm2)")
    p.add_argument("--drafter", default=None, help="optional drafter to speed it up")
    p.add_argument("--policy", choices=POLICIES, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--batch", type=int, default=32, help="concurrent requests")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--compile",
        action="store_true",
        help="compiled decode steps (one request and batches; minutes to compile, in the "
        "background: worth it for long runs)",
    )
    p.set_defaults(func=cmd_regenerate)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text for one or more prompts and print round statistics"
    )
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument(
        "--target",
        default=None,
        help="model folder, default model name or hub id "
        "(default: smollm2, pulled into the cache on first use)",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="DFlash drafter folder, or 'none' for plain "
        "decoding (default: the drafter shipped for the default target)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="verify-length policy (default: head with a drafter, ar without)",
    )
    p.add_argument("--gamma", type=float, default=1.0, help="load-scaling factor γ of k̂")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print outputs and stats as JSON")
    p.set_defaults(func=cmd_generate)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The pure sub-commands (no training, database or web stack)."""
    _add_generate(sub)
    _add_pull(sub)
    _add_regenerate(sub)
    _add_drafter_data(sub)


def run(args: argparse.Namespace) -> int:
    """Run a parsed sub-command; expected failures print one line and exit 2."""
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, PullError) as exc:
        print(f"adaflash: error: {exc}", file=sys.stderr)
        return 2
