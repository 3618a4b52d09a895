"""The ``adaflash`` command line: core sub-commands (``adaflash.cli``) plus training, the trainer
service and the server — one sub-command per plain function."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from adaflash import cli as core
from adaflash.config import DEFAULT_BLOCK_SIZE, POLICIES, SUFFIX_SCOPES, DistillConfig
from adaflash.models.target import load_target
from adaflash.paths import write_text_atomic
from adaflash.tokenizer import Tokenizer

if TYPE_CHECKING:  # lightning and APScheduler load only for the commands that train
    from app.training.trainer import TrainerConfig
    from lightning_modules.online import OnlineConfig


# Flags default to None: a setting left out takes its dataclass default, its one home.
DISTILL_FLAGS = {  # flag dest → DistillConfig field
    "loss": "loss",
    "epochs": "epochs",
    "max_steps": "max_steps",
    "max_minutes": "max_minutes",
    "anchors": "anchors_per_seq",
    "lr": "drafter_lr",
    "head_lr": "head_lr",
    "bf16_autocast": "bf16_autocast",
    "seed": "seed",
    "batch_size": "batch_size",
    "accumulate": "accumulate",
    "lr_schedule": "lr_schedule",
    "warmup": "warmup_fraction",
    "supervised_slots": "supervised_slots",
    "slot_decay": "slot_decay",
    "strategy": "strategy",
    "devices": "devices",
    "num_nodes": "num_nodes",
}
ONLINE_FLAGS = {
    "min_new": "min_new",
    "max_samples": "max_samples",
    "gate_margin": "gate_margin",
    "replay": "replay",
    "retain": "retain",
    "retain_from": "retain_from",
}


def _given(args: argparse.Namespace, names: dict[str, str]) -> dict[str, Any]:
    return {f: getattr(args, a) for a, f in names.items() if getattr(args, a, None) is not None}


def distill_config(args: argparse.Namespace) -> DistillConfig:
    kw = _given(args, DISTILL_FLAGS)
    if isinstance(kw.get("devices"), str) and kw["devices"].isdigit():
        kw["devices"] = int(kw["devices"])
    return DistillConfig(**kw)


def online_config(args: argparse.Namespace) -> OnlineConfig:
    from lightning_modules.online import OnlineConfig

    return OnlineConfig(distill=distill_config(args), **_given(args, ONLINE_FLAGS))


def trainer_config(args: argparse.Namespace, threads: str = "threads") -> TrainerConfig:
    from app.training.trainer import TrainerConfig

    names = {"poll_s": "poll_s", "interval": "interval_minutes", "nice": "nice", threads: "threads"}
    return TrainerConfig(**_given(args, names))


def add_distill_args(p: argparse.ArgumentParser) -> None:
    """How the drafter trains (``DistillConfig``); unset flags keep its defaults."""
    p.add_argument(
        "--loss",
        choices=["opd", "osd"],
        default=None,
        help="opd = hard CE + clipped reverse KL (AdaFlash, default); osd = forward KL",
    )
    p.add_argument("--epochs", type=int, default=None, help="passes over the data")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--anchors", type=int, default=None, help="anchors per sequence")
    p.add_argument("--lr", type=float, default=None, help="drafter learning rate")
    p.add_argument("--head-lr", type=float, default=None, help="length-head learning rate")
    p.add_argument("--bf16-autocast", action="store_true", default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    p.add_argument("--accumulate", type=int, default=None, help="steps per optimizer update")
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default=None)
    p.add_argument("--warmup", type=float, default=None, help="warmup fraction of the run")
    p.add_argument(
        "--supervised-slots", type=int, default=None, help="teach draft slots 1 … n only"
    )
    p.add_argument("--slot-decay", type=float, default=None, help="w_i = exp(−(i−1)/decay)")
    p.add_argument(
        "--strategy",
        choices=["auto", "ddp", "fsdp"],
        default=None,
        help="Lightning strategy for several GPUs or nodes",
    )
    p.add_argument("--devices", default=None, help="GPUs per node (CPU runs use one process)")
    p.add_argument("--num-nodes", type=int, default=None)


def add_online_args(p: argparse.ArgumentParser) -> None:
    """What an online training round does (``OnlineConfig`` + ``DistillConfig``)."""
    p.add_argument("--min-new", type=int, default=None, help="train at this many new trajectories")
    p.add_argument("--max-samples", type=int, default=None, help="trajectories per round")
    p.add_argument(
        "--gate-margin",
        type=float,
        default=None,
        help="τ a candidate must gain over the active version to be promoted (0: not worse)",
    )
    p.add_argument(
        "--replay",
        type=int,
        default=None,
        help="trajectories of earlier rounds each round trains on again with the new ones",
    )
    p.add_argument(
        "--retain",
        type=int,
        default=None,
        help="trajectories of --retain-from each round also trains on (default 128; 0: none), so "
        "traffic that moved to one domain does not pull the drafter from the others",
    )
    p.add_argument(
        "--retain-from",
        nargs="+",
        default=None,
        help="trajectory files (JSONL or .jsonl.gz) for --retain "
        "(default: the shipped drafter's chat and code trajectories)",
    )
    add_distill_args(p)


def add_trainer_process_args(p: argparse.ArgumentParser) -> None:
    """How the trainer process runs (``TrainerConfig``)."""
    p.add_argument("--interval", type=float, default=None, help="also train every N minutes")
    p.add_argument("--poll-s", type=float, default=None)
    p.add_argument("--nice", type=int, default=None)


def cmd_train(args: argparse.Namespace) -> int:
    """Train a drafter + length head on trajectory files; write a DFlash-format folder.

    With ``--cache`` the target's teacher outputs for the trajectories go to (or are reused
    from) that folder once; without it they are computed in memory. ``--init`` continues a
    drafter (chained runs: blocks seen and the learning curve carry on)."""
    from adaflash.models.draft_vocab import build_draft_vocab, count_tokens, coverage
    from adaflash.models.drafter import load_drafter
    from adaflash.pull import resolve_target
    from adaflash.teacher_cache import CachedSequence, build_cache, cache_key
    from adaflash.workloads import read_trajectories
    from lightning_modules.train import fit, new_drafter, save_run

    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target)
    target = load_target(target_dir, args.target_dtype)
    train = read_trajectories([Path(p) for p in args.trajectories])
    val = read_trajectories([Path(p) for p in args.val]) if args.val else []
    offset = 0
    if args.init:
        drafter = load_drafter(args.init, "float32")
        drafter.cfg.check_target(target.cfg)
        card = Path(args.init) / "training.json"
        if card.is_file():
            offset = int(json.loads(card.read_text()).get("result", {}).get("blocks_seen") or 0)
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
            seed=distill_config(args).seed,
        )
    if args.draft_vocab is not None:
        if args.draft_vocab == 0:
            drafter.set_draft_vocab(None)
        else:
            counts = count_tokens((t.response_ids for t in train), target.cfg.vocab_size)
            ids = build_draft_vocab(counts, args.draft_vocab, target.cfg.eos_token_ids)
            drafter.set_draft_vocab(
                ids,
                {
                    "built_from": "response tokens of the training trajectories",
                    "train_coverage": round(coverage(ids, counts), 5),
                },
            )
    cfg = distill_config(args)
    if args.cache:
        key = cache_key(target_dir, drafter.cfg.target_layer_ids, cfg.top_k)

        def report(done: int, total: int) -> None:
            print(f"[train] teacher cache: {done}/{total} new trajectories", flush=True)

        train_src = build_cache(Path(args.cache) / "train", target, key, train, progress=report)
        val_src = build_cache(Path(args.cache) / "val", target, key, val) if val else None
    else:
        train_src, val_src = train, val or None  # type: ignore[assignment]
    curve_sets = {}
    if args.curve_every and val_src is not None:
        from lightning_modules.train import cached

        seqs = [
            s for s in cached(target, val_src, drafter, cfg.top_k) if isinstance(s, CachedSequence)
        ]
        for domain in sorted({s.domain for s in seqs}):
            curve_sets[domain] = [s for s in seqs if s.domain == domain][: args.curve_seqs]
    curve_path = Path(args.curve) if args.curve else None

    def write_curve(points: list[dict[str, Any]]) -> None:
        """Keep the earlier runs' points (up to where this one starts) and add this run's."""
        assert curve_path is not None
        old = json.loads(curve_path.read_text()) if curve_path.is_file() else {"points": []}
        kept = [p for p in old["points"] if p["blocks"] <= offset]  # the parent run ends at offset
        curve_path.parent.mkdir(parents=True, exist_ok=True)
        curve = {"points": kept + [{**p, "run": args.title} for p in points]}
        write_text_atomic(curve_path, json.dumps(curve, indent=1) + "\n")

    result = fit(
        drafter,
        target,
        train_src,
        val_src,
        cfg,
        log_dir=Path(args.out) / "logs",
        curve_sets=curve_sets,
        curve_every=args.curve_every,
        blocks_offset=offset,
        on_curve=write_curve if curve_path else None,
    )
    data = {
        "trajectories": [str(p) for p in args.trajectories],
        "sequences": len(train),
        "domains": sorted({t.domain for t in train}),
        "target": Path(target_dir).name,
        "init": args.init or ("random" if args.random_init else "target layers"),
        "draft_vocab": drafter.draft_vocab_size,
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
    add_distill_args(p)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--layers", type=int, default=3, help="drafter layers (from scratch)")
    p.add_argument(
        "--num-features",
        type=int,
        default=None,
        help="K target layers (default: as many as drafter layers)",
    )
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument(
        "--random-init",
        action="store_true",
        help="random drafter layers instead of copies of the target's last layers",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft from the N most frequent response tokens (0: the whole vocabulary; "
        "default: a new drafter drafts from all, --init keeps its own)",
    )
    p.add_argument("--cache", default=None, help="teacher cache folder (built once, resumable)")
    p.add_argument(
        "--curve-every", type=int, default=0, help="replay --val every N blocks (learning curve)"
    )
    p.add_argument("--curve-seqs", type=int, default=32, help="held-out sequences per domain")
    p.add_argument("--curve", default=None, help="learning-curve JSON to extend")
    p.add_argument("--title", default="AdaFlash drafter")
    p.set_defaults(func=cmd_train)


def cmd_trainer(args: argparse.Namespace) -> int:
    """The online trainer service: buffer → training rounds → versions (app/training/trainer.py).

    Settings come from flags, or from ``--settings`` (the JSON that ``serve`` writes for the
    trainer it starts, so both processes train with the same configuration)."""
    from adaflash.pull import resolve_target
    from app.training.trainer import TrainerConfig, TrainerService
    from db.registry import Registry
    from db.session import data_dir, make_engine, migrate
    from lightning_modules.online import OnlineConfig

    db = make_engine(args.database_url)
    migrate(db)
    registry = Registry(db, args.weights_dir or data_dir() / "weights")
    if args.settings:
        raw = json.loads(Path(args.settings).read_text())
        online = OnlineConfig.from_dict(raw["online"])
        process = TrainerConfig(**raw["trainer"])
    else:
        online, process = online_config(args), trainer_config(args)
    service = TrainerService(db, registry, resolve_target(args.target), online, process)
    if args.once:
        from db.runs import claim_run
        from lightning_modules.online import training_round

        service.prepare()
        run_id = claim_run(db, "manual")
        if run_id is None:
            print("another training run is in progress")
            return 1
        outcome = training_round(db, registry, service.target, service.online, run_id)
        print(
            json.dumps(
                {
                    "run": outcome.run_id,
                    "status": outcome.status,
                    "version": outcome.version_id,
                    "promoted": outcome.promoted,
                    "reason": outcome.reason,
                }
            )
        )
        return 0 if outcome.status != "failed" else 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    service.start()
    logging.getLogger("adaflash.trainer").info("trainer running; Ctrl-C stops it")
    stop.wait()
    service.stop()
    # Runs are recorded (a round cut short as failed, its Lightning thread would otherwise hold
    # the interpreter until it ends); skip the seconds of torch/lightning teardown.
    logging.shutdown()
    os._exit(0)


def _add_trainer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trainer",
        help="run the online trainer (APScheduler): trains when enough "
        "new trajectories exist, on an interval, or on request",
    )
    p.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy URL (default: SQLite file under $ADAFLASH_DATA or ./data)",
    )
    p.add_argument("--weights-dir", default=None, help="version folders (default: data/weights)")
    p.add_argument("--target", default=None, help="model folder or name (default: smollm2)")
    p.add_argument("--settings", default=None, help="JSON settings (written by serve)")
    p.add_argument("--once", action="store_true", help="run one round now and exit")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    add_trainer_process_args(p)
    add_online_args(p)
    p.set_defaults(func=cmd_trainer)


def cmd_serve(args: argparse.Namespace) -> int:
    """API + UI + engine in one process, the trainer beside it (see app/service.py)."""
    import uvicorn

    from app.api.server import create_app
    from app.service import ServeConfig, Service

    cfg = ServeConfig.from_env(
        backend=args.backend,
        host=args.host,
        port=args.port,
        target=args.target,
        drafter=args.drafter,
        database_url=args.database_url,
        weights_dir=args.weights_dir,
        policy=args.policy,
        gamma=args.gamma,
        suffix=args.suffix,
        dtype=args.dtype,
        max_temperature=args.max_temperature,
        max_new_tokens=args.max_new_tokens,
        max_running_requests=args.max_running_requests,
        admin_token=args.admin_token,
        trainer=False if args.no_trainer else None,
        compile=False if args.no_compile else None,
        threads=args.threads,
        default_temperature=args.default_temperature,
        default_top_p=args.default_top_p,
        default_top_k=args.default_top_k,
        online=online_config(args),
        trainer_process=trainer_config(args, threads="trainer_threads"),
    )
    service = Service(cfg)
    app = create_app(service, ui=not args.no_ui)
    base = f"http://{cfg.host}:{cfg.port}"
    print(
        f"AdaFlash serving {service.model_name} with drafter {service.backend.version} "
        f"(policy {service.backend.policy})\n"
        f"  chat UI + dashboard: {base}/ui/\n"
        f"  OpenAI API:          {base}/v1  (model {service.model_name!r})\n"
        f"  SGLang API:          {base}/generate\n"
        f"  metrics:             {base}/metrics\n"
        f"  API docs:            {base}/docs\n"
        f"  admin:               {'enabled' if cfg.admin_token else 'disabled (no token)'}\n"
        "Ctrl-C stops (streams finish or are cancelled, the buffer is flushed).",
        flush=True,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level="warning",
            timeout_graceful_shutdown=int(cfg.drain_seconds) + 5,
        )
    )

    def on_signal(*_: object) -> None:
        # first Ctrl-C: graceful (streams finish or are cancelled, buffer flushed); second: now
        server.force_exit = server.should_exit
        server.should_exit = True

    # our handlers instead of uvicorn's, which re-raise Ctrl-C after shutting down
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server.run()
    print("AdaFlash stopped.", flush=True)
    # Everything is persisted and every thread has stopped; skip the interpreter's teardown of
    # torch and gradio, which takes seconds on an idle server.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the OpenAI/SGLang APIs, the UI and the dashboard "
        "(embedded default: SmolLM2 + the shipped drafter)",
    )
    p.add_argument(
        "--backend",
        choices=["adaflash", "sglang"],
        default=None,
        help="engine backend (default adaflash; sglang needs CUDA)",
    )
    p.add_argument("--host", default=None, help="default 127.0.0.1 (ADAFLASH_HOST)")
    p.add_argument("--port", type=int, default=None, help="default 8000 (ADAFLASH_PORT)")
    p.add_argument("--target", default=None, help="model folder or name (default: smollm2)")
    p.add_argument("--drafter", default=None, help="drafter folder or 'none' (default: shipped)")
    p.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy URL (default: SQLite file under $ADAFLASH_DATA or ./data)",
    )
    p.add_argument("--weights-dir", default=None)
    p.add_argument("--policy", choices=POLICIES, default=None)
    p.add_argument("--gamma", type=float, default=None)
    p.add_argument(
        "--suffix",
        choices=SUFFIX_SCOPES,
        default=None,
        help="suffix drafts from a request's own tokens and recently served ones (global, the "
        "default), its own alone (request: no request's speed depends on another's text), or off",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    p.add_argument("--max-temperature", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None, help="per-request ceiling")
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument(
        "--admin-token", default=None, help="enables the admin API and tab (ADAFLASH_ADMIN_TOKEN)"
    )
    p.add_argument("--default-temperature", type=float, default=None)
    p.add_argument("--default-top-p", type=float, default=None)
    p.add_argument("--default-top-k", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    p.add_argument("--no-ui", action="store_true")
    p.add_argument("--no-trainer", action="store_true", help="do not start the trainer")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="eager batch-1 decode steps only (default: compiled in the background, ~70 s)",
    )
    p.add_argument("--trainer-threads", type=int, default=None, help="default 1")
    add_trainer_process_args(p)
    add_online_args(p)
    p.set_defaults(func=cmd_serve)


DEMO_FLAGS = {  # flag dest → DemoConfig field (unset flags keep its defaults)
    "url": "url",
    "port": "port",
    "prompts": "prompts",
    "concurrency": "concurrency",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "versions": "versions",
    "minutes": "minutes",
    "settle_s": "settle_s",
    "report_s": "report_s",
}


def cmd_demo(args: argparse.Namespace) -> int:
    """A shifted-domain workload through the real API while the drafter adapts (app/demo.py)."""
    from app.demo import DemoConfig
    from app.demo import run as run_demo
    from db.session import data_dir

    cfg = DemoConfig(
        **_given(args, DEMO_FLAGS),
        keep_serving=args.keep_serving,
        serve_args=tuple(args.serve_args),
    )
    try:
        summary = run_demo(cfg, data_dir(), Path(args.out) if args.out else None)
    except RuntimeError as exc:
        print(f"adaflash: error: {exc}", file=sys.stderr)
        return 1
    if summary["requests_done"] == 0:
        print(f"adaflash: error: no request was answered ({summary['stopped']})", file=sys.stderr)
        return 1
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="stream a new-domain workload (default: math) through the API and watch the "
        "drafter adapt on the dashboard",
        description="Starts `adaflash serve` (or uses a running server) and sends a steady "
        "workload through its OpenAI API while the trainer adapts the drafter; prints τ, "
        "verify length and tokens/s per window and per version. Flags after `--` go to "
        "the server it starts.",
    )
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--port", type=int, default=None, help="port of the server (default 8000)")
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL file, a 'prompt' per line (default: workloads/math_train.jsonl)",
    )
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (1)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (128)")
    p.add_argument("--temperature", type=float, default=None, help="default 0: greedy")
    p.add_argument(
        "--versions", type=int, default=None, help="stop after N new versions (3; 0: never)"
    )
    p.add_argument("--minutes", type=float, default=None, help="stop after M minutes (60)")
    p.add_argument(
        "--settle-s",
        type=float,
        default=None,
        help="after the N-th new version, serve this long before stopping (60)",
    )
    p.add_argument("--report-s", type=float, default=None, help="seconds between lines (10)")
    p.add_argument("--keep-serving", action="store_true", help="leave a server it started running")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("serve_args", nargs="*", help="after `--`: flags for `adaflash serve`")
    p.set_defaults(func=cmd_demo)


def main(argv: Sequence[str] | None = None) -> int:
    from adaflash.engine.engine import bound_onednn_cache

    bound_onednn_cache()  # before anything runs a matmul: oneDNN reads it once
    parser = argparse.ArgumentParser(prog="adaflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    core.add_commands(sub)
    _add_train(sub)
    _add_trainer(sub)
    _add_serve(sub)
    _add_demo(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # the trainer's 10 s tick logged two lines each (236 of a demo trainer.log's lines); its
    # warnings (a missed or failed job) still show
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    return core.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
