"""The ``adaflash`` command line: one sub-command per plain function."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
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


def cmd_generate(args: argparse.Namespace) -> int:
    cfg = EngineConfig(
        policy=args.policy, gamma=args.gamma, dtype=args.dtype, num_threads=args.threads
    )
    engine, tok = build_engine(args.target, args.drafter, cfg)
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
    """Let the target answer workload prompts (greedy, batched); append trajectories (resumable)."""
    from tqdm import tqdm

    from adaflash.pull import resolve_target
    from adaflash.workloads import Prompt, Trajectory, load_prompts

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.is_file():
        done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.strip()}
    prompts = [p for p in load_prompts(args.domain, args.split, args.limit) if p.id not in done]
    if not prompts:
        print(f"{out}: all {len(done)} prompts already answered")
        return 0
    cfg = EngineConfig(
        policy=args.policy,
        dtype=args.dtype,
        num_threads=args.threads,
        max_running_requests=args.batch,
    )
    engine, tok = build_engine(resolve_target(args.target), args.drafter, cfg)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    bar = tqdm(
        total=len(prompts) + len(done),
        initial=len(done),
        desc=f"regenerate {out.name}",
        unit="prompt",
    )
    with out.open("a", encoding="utf-8") as f:
        for p in prompts:
            ids = encode_prompt(tok, p.prompt, chat=True)

            def write(rec: RequestRecord, p: Prompt = p, ids: list[int] = ids) -> None:
                traj = Trajectory(
                    p.id,
                    p.domain,
                    ids,
                    list(rec.output_ids),
                    rec.output_text or "",
                    rec.finish_reason,
                )
                f.write(traj.to_json() + "\n")
                f.flush()
                bar.update(1)

            engine.add_request(ids, params, request_id=p.id, domain=p.domain, on_finish=write)
        while engine.has_work:
            engine.step()
    bar.close()
    print(
        f"{out}: {len(prompts) + len(done)} trajectories; {engine.stats.output_tokens} new tokens"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train a drafter + length head on trajectory files; write a DFlash-format folder."""
    from adaflash.config import DistillConfig
    from adaflash.models.drafter import load_drafter
    from adaflash.pull import resolve_target
    from adaflash.workloads import read_trajectories
    from lightning_modules.train import fit, new_drafter, save_run

    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.target_dtype)
    train = read_trajectories([Path(p) for p in args.trajectories])
    val = read_trajectories([Path(p) for p in args.val]) if args.val else None
    if args.init:
        drafter = load_drafter(args.init, "float32")
        drafter.cfg.check_target(target.cfg)
    else:
        mask = (
            args.mask_token_id
            if args.mask_token_id is not None
            else Tokenizer.from_folder(target_dir).mask_token_id(target.cfg.vocab_size)
        )
        drafter = new_drafter(
            target,
            mask_token_id=mask,
            num_layers=args.layers,
            num_features=args.num_features,
            intermediate_size=args.intermediate_size,
            block_size=args.block_size,
            init_from_target=not args.random_init,
            seed=args.seed,
        )
    cfg = DistillConfig(
        loss=args.loss,
        epochs=args.epochs,
        anchors_per_seq=args.anchors,
        max_steps=args.max_steps,
        max_minutes=args.max_minutes,
        drafter_lr=args.lr,
        head_lr=args.head_lr,
        bf16_autocast=args.bf16_autocast,
        seed=args.seed,
    )
    result = fit(drafter, target, train, val, cfg, log_dir=Path(args.out) / "logs")
    data = {
        "trajectories": [str(p) for p in args.trajectories],
        "sequences": len(train),
        "domains": sorted({t.domain for t in train}),
        "target": str(target_dir),
        "init": args.init or ("random" if args.random_init else "target layers"),
    }
    save_run(
        result,
        Path(args.out),
        title=args.title,
        data=data,
        cfg=cfg,
        metadata={"parent": args.init or "scratch"},
    )
    print(json.dumps(result.summary(), indent=2))
    print(f"wrote {args.out}")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a drafter + length head on trajectories (Lightning)")
    p.add_argument("trajectories", nargs="+", help="trajectory JSONL files (adaflash regenerate)")
    p.add_argument("--out", required=True, help="output DFlash-format folder")
    p.add_argument("--target", default=None, help="model folder or name (default: smollm2)")
    p.add_argument("--target-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--init", default=None, help="start from this drafter folder")
    p.add_argument("--val", nargs="*", default=None, help="held-out trajectory files")
    p.add_argument("--loss", choices=["opd", "osd"], default="opd")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--head-lr", type=float, default=2e-4)
    p.add_argument("--bf16-autocast", action="store_true")
    p.add_argument("--layers", type=int, default=3, help="drafter layers (from scratch)")
    p.add_argument(
        "--num-features",
        type=int,
        default=None,
        help="K target layers (default: as many as drafter layers)",
    )
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument(
        "--random-init",
        action="store_true",
        help="random drafter layers instead of copies of the target's last layers",
    )
    p.add_argument("--title", default="AdaFlash drafter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_train)


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
    p.add_argument("--domain", choices=DOMAINS, required=True)
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--out", required=True, help="trajectory JSONL (appended; reruns resume)")
    p.add_argument("--target", default=None, help="model folder or name (default: smollm2)")
    p.add_argument("--drafter", default=None, help="optional drafter to speed it up")
    p.add_argument("--policy", choices=POLICIES, default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--batch", type=int, default=16, help="concurrent requests")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_regenerate)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text for one or more prompts and print round statistics"
    )
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--target", required=True, help="Hugging Face folder of the target model")
    p.add_argument("--drafter", help="DFlash drafter folder (omit for plain decoding)")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="adaflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_pull(sub)
    _add_regenerate(sub)
    _add_train(sub)
    args = parser.parse_args(argv)
    if getattr(args, "policy", "unset") is None:
        args.policy = "head" if getattr(args, "drafter", None) else "ar"
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, PullError) as exc:
        print(f"adaflash: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
