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
from adaflash.engine.request import TokenEvent
from adaflash.models.drafter import load_drafter
from adaflash.models.target import load_target
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
    args = parser.parse_args(argv)
    if getattr(args, "policy", "unset") is None:
        args.policy = "head" if getattr(args, "drafter", None) else "ar"
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"adaflash: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
