"""Everything `adaflash serve` runs in one process, built from one frozen config.

The engine thread (EngineRunner), the buffer writer, the version watcher and — as a separate OS
process — the trainer. ``start()`` / ``stop()`` are explicit; nothing happens at import.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from adaflash.cli import resolve_drafter
from adaflash.config import POLICIES, EngineConfig, Policy, SamplingParams, TargetConfig
from adaflash.engine.engine import Engine
from adaflash.engine.records import QueueSink
from adaflash.engine.runner import EngineRunner
from adaflash.models.target import load_target
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from app.hotswap import VersionWatcher
from app.sglang_engine import SGLangBackend
from db.buffer import BufferWriter
from db.registry import Registry, VersionError, file_sha256
from db.session import data_dir, make_engine, migrate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """`adaflash serve` settings. Each field can also come from ``ADAFLASH_<FIELD>``."""

    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "adaflash"  # or "sglang" (CUDA hosts; see app/sglang_backend.py)
    target: str | None = None  # folder, default model name or hub id; default smollm2
    drafter: str | None = None  # folder or "none"; default: the shipped drafter
    database_url: str | None = None  # default: SQLite under the data dir
    weights_dir: str | None = None  # default: <data dir>/weights
    policy: Policy = "head"
    gamma: float = 1.0
    dtype: str = "bfloat16"
    max_temperature: float = 2.0
    max_new_tokens: int = 1024  # per-request ceiling
    max_running_requests: int = 16
    max_batch_tokens: int = 512
    admin_token: str | None = None  # admin endpoints are disabled without one
    trainer: bool = True  # spawn `adaflash trainer` beside the server
    min_new: int = 128
    train_interval_minutes: float | None = None
    trainer_threads: int = 1
    threads: int | None = None
    max_body_bytes: int = 1_000_000
    drain_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1…65535, got {self.port}")
        if self.max_temperature < 0 or self.gamma <= 0:
            raise ValueError("max_temperature must be ≥ 0 and gamma > 0")
        if self.backend not in ("adaflash", "sglang"):
            raise ValueError(f"backend must be adaflash or sglang, got {self.backend!r}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin token must be at least 8 characters")

    @classmethod
    def from_env(cls, **overrides: Any) -> ServeConfig:
        """Defaults < ``ADAFLASH_*`` environment variables < explicit overrides (CLI flags)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get(f"ADAFLASH_{f.name.upper()}")
            if raw is None:
                continue
            kind = str(f.type)
            if "bool" in kind:
                values[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif "int" in kind and "float" not in kind:
                values[f.name] = int(raw)
            elif "float" in kind:
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class Service:
    def __init__(self, cfg: ServeConfig) -> None:
        if cfg.backend == "sglang":
            from app.sglang_backend import require_sglang

            require_sglang()  # refuses with the reason on this machine
        self.cfg = cfg
        self.started_at = time.time()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.target_dir = resolve_target(cfg.target)
        self.model_name = self.target_dir.name
        self.tokenizer = Tokenizer.from_folder(self.target_dir)
        self.db_url = cfg.database_url or f"sqlite:///{data_dir() / 'adaflash.db'}"
        self.db = make_engine(self.db_url)
        migrate(self.db)
        self.registry = Registry(self.db, cfg.weights_dir or data_dir() / "weights")
        drafter_dir = resolve_drafter(cfg.drafter, cfg.target)
        version, drafter, served_dir = self._initial_drafter(drafter_dir)
        self.sink = QueueSink(maxsize=50_000)
        self.engine: Engine | SGLangBackend
        self.runner: EngineRunner | SGLangBackend
        if cfg.backend == "sglang":
            if drafter is None or served_dir is None:
                raise ValueError(
                    "the SGLang backend serves a DFlash drafter; --drafter none is not"
                )
            self.target = None
            self.engine = self.runner = self._sglang_backend(drafter, served_dir, version)
        else:
            self.target = load_target(self.target_dir, cfg.dtype)
            eos = tuple(
                sorted(set(self.target.cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids))
            )
            self.engine = Engine(
                self.target,
                drafter,
                EngineConfig(
                    policy=cfg.policy if drafter is not None else "ar",
                    gamma=cfg.gamma,
                    dtype=cfg.dtype,
                    max_running_requests=cfg.max_running_requests,
                    max_batch_tokens=max(cfg.max_batch_tokens, 16),
                ),
                sink=self.sink,
                drafter_version=version,
                detokenize=self.tokenizer.decode,
                eos_token_ids=eos,
            )
            self.runner = EngineRunner(self.engine)
        self.writer = BufferWriter(self.db, self.sink)
        self.watcher = VersionWatcher(self.engine, self.registry, cfg.dtype)
        self.trainer: subprocess.Popen[bytes] | None = None
        self.swap_log: list[tuple[float, str]] = [(time.time(), version)]
        self.watcher.on_swap = lambda v: self.swap_log.append((time.time(), v))

    def _sglang_backend(self, drafter: Any, folder: Path, version: str) -> SGLangBackend:
        """SGLang serves the target with ``folder`` as its DFLASH drafter (CUDA hosts)."""
        from app.sglang_engine import EmbeddedSGLang, draft_tensors, embedded_sglang_args

        args = embedded_sglang_args(
            str(self.target_dir), str(folder), self.cfg.dtype, self.cfg.max_running_requests
        )
        return SGLangBackend(
            lambda: EmbeddedSGLang(**args),
            target_cfg=TargetConfig.from_folder(self.target_dir),
            drafter_cfg=drafter.cfg,
            initial_weights=draft_tensors(drafter),
            version=version,
            decode=self.tokenizer.decode,
            sink=self.sink,
        )

    def _initial_drafter(self, folder: str | None) -> tuple[str, Any, Path | None]:
        """Serve the registry's active version; register the shipped (or given) drafter as a
        version first when it is not there yet. A broken active version falls back to the
        folder, and serving still starts. Returns (version, drafter, its folder)."""
        if folder is None:
            return "none", None, None
        weights = Path(folder) / "model.safetensors"
        sha = file_sha256(weights)
        known = {v.sha256: v for v in self.registry.list()}
        if sha not in known:
            vid = "v0000" if not known else self.registry.next_id()
            self.registry.register_folder(Path(folder), vid, note=f"from {folder}")
        elif self.registry.active() is None:
            self.registry.activate(known[sha].id)
        active = self.registry.active()
        assert active is not None
        try:
            return active.id, self.registry.load(active.id, self.cfg.dtype), active.path
        except VersionError as exc:
            log.error("active version unusable (%s); serving %s instead", exc, folder)
            from adaflash.models.drafter import load_drafter

            return (
                f"file:{Path(folder).name}",
                load_drafter(folder, self.cfg.dtype),
                Path(folder),
            )

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.runner.start()
        self.writer.start()
        self.watcher.start()
        if self.cfg.trainer and self.engine.drafter is not None:
            self.trainer = self._spawn_trainer()

    def _spawn_trainer(self) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "app.cli",
            "trainer",
            "--database-url",
            self.db_url,
            "--weights-dir",
            str(self.registry.weights_dir),
            "--target",
            str(self.target_dir),
            "--min-new",
            str(self.cfg.min_new),
            "--threads",
            str(self.cfg.trainer_threads),
        ]
        if self.cfg.train_interval_minutes:
            cmd += ["--interval", str(self.cfg.train_interval_minutes)]
        log_path = self.registry.weights_dir.parent / "trainer.log"
        log.info("starting trainer process (log: %s)", log_path)
        with log_path.open("ab") as out:
            return subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> None:
        """Finish or cancel streams, flush the queue, stop the trainer."""
        self.runner.stop(drain_timeout_s=self.cfg.drain_seconds)
        self.watcher.stop()
        if not self.writer.stop(timeout_s=15):
            log.error("could not flush %d buffered records before exit", self.writer.stats.pending)
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.terminate()
            try:
                self.trainer.wait(20)
            except subprocess.TimeoutExpired:
                self.trainer.kill()
        self.db.dispose()
        log.warning(
            "stopped: %d trajectories and %d rounds written, %d records dropped",
            self.writer.stats.written_trajectories,
            self.writer.stats.written_rounds,
            self.sink.dropped,
        )

    # -- helpers for the API and UI -----------------------------------------------------------
    def sampling(
        self,
        *,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        max_new_tokens: int | None,
        stop: tuple[str, ...] = (),
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        seed: int | None = None,
        prompt_len: int = 0,
    ) -> SamplingParams:
        """SamplingParams from API fields, with the server's limits; ValueError says why."""
        t = 1.0 if temperature is None else temperature
        if t > self.cfg.max_temperature:
            raise ValueError(
                f"temperature {t} is above this server's limit {self.cfg.max_temperature}"
            )
        room = self.engine.max_context - prompt_len
        if room < 1:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) fills the context window of "
                f"{self.engine.max_context} tokens"
            )
        n = (
            max_new_tokens
            if max_new_tokens is not None
            else min(256, room, self.cfg.max_new_tokens)
        )
        if n > self.cfg.max_new_tokens:
            raise ValueError(
                f"max tokens {n} is above this server's limit {self.cfg.max_new_tokens}"
            )
        if n > room:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max tokens ({n}) exceeds the "
                f"context window of {self.engine.max_context} tokens"
            )
        return SamplingParams(
            temperature=t,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k or 0,
            max_new_tokens=n,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            seed=seed,
        )

    def trainer_alive(self) -> bool:
        return self.trainer is not None and self.trainer.poll() is None

    def remove_data(self) -> None:  # used by tests that build throwaway services
        shutil.rmtree(self.registry.weights_dir, ignore_errors=True)
