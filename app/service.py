"""Everything `adaflash serve` runs in one process, built from one frozen config, and the one
facade the HTTP routes and the UI use.

The serving backend (``app.backends.Backend``: the embedded engine thread, or SGLang), the
buffer writer, the version watcher and — as a separate OS process — the trainer. ``start()`` /
``stop()`` are explicit; nothing happens at import. Admin actions and dashboard queries are
methods here, so the API and the UI do the same thing the same way; they touch the database or
load weights, so async callers run them in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from adaflash.cli import resolve_drafter
from adaflash.config import (
    DEFAULT_BLOCK_SIZE,
    POLICIES,
    SUFFIX_SCOPES,
    EngineConfig,
    Policy,
    SamplingDefaults,
    SamplingParams,
    TargetConfig,
)
from adaflash.engine.engine import Engine
from adaflash.engine.records import QueueSink
from adaflash.engine.runner import EngineRunner
from adaflash.metrics import Bucket, SpecCounters, probe_buckets
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.target import load_target
from adaflash.pull import resolve_target
from adaflash.tokenizer import Tokenizer
from app.backends import Backend
from app.training.hotswap import VersionWatcher
from app.training.trainer import TrainerConfig
from db import stats
from db.buffer import BufferWriter
from db.registry import Registry, Version, VersionError, file_sha256
from db.runs import fail_stale_runs, list_runs, request_run
from db.session import data_dir, make_engine, migrate
from lightning_modules.online import OnlineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """`adaflash serve` settings. Each simple field can also come from ``ADAFLASH_<FIELD>``;
    what the trainer process trains with is ``online`` (``OnlineConfig``, its one home)."""

    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "adaflash"  # or "sglang" (CUDA hosts; see app/backends/sglang_checks.py)
    target: str | None = None  # folder, default model name or hub id; default smollm2
    drafter: str | None = None  # folder or "none"; default: the shipped drafter
    database_url: str | None = None  # default: SQLite under the data dir
    weights_dir: str | None = None  # default: <data dir>/weights
    policy: Policy = "cost"
    gamma: float = 1.0
    suffix: str = "global"  # what suffix drafts come from (``EngineConfig.suffix``)
    dtype: str = "bfloat16"
    max_temperature: float = 2.0
    max_new_tokens: int | None = None  # per-request ceiling; None = the context window
    default_temperature: float | None = None  # request defaults; None: generation_config.json
    default_top_p: float | None = None
    default_top_k: int | None = None
    max_running_requests: int = 16
    max_batch_tokens: int = 512
    admin_token: str | None = None  # admin endpoints are disabled without one
    trainer: bool = True  # spawn `adaflash trainer` beside the server
    compile: bool = True  # batch-1 decode steps compiled in the background (models/decode_graph.py)
    threads: int | None = None
    max_body_bytes: int = 1_000_000
    drain_seconds: float = 10.0
    online: OnlineConfig = field(default_factory=OnlineConfig)
    trainer_process: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.suffix not in SUFFIX_SCOPES:
            raise ValueError(f"suffix must be one of {SUFFIX_SCOPES}, got {self.suffix!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be 1…65535, got {self.port}")
        if self.max_temperature < 0 or self.gamma <= 0:
            raise ValueError("max_temperature must be ≥ 0 and gamma > 0")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be ≥ 1 (or unset: the context window)")
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
            kind = str(f.type)
            if raw is None or "Config" in kind:
                continue
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


@dataclass(frozen=True)
class Dashboard:
    """What the dashboard shows for one window (rates derived by ``SpecCounters``)."""

    window_s: float
    now: float
    buckets: list[Bucket]
    versions: list[tuple[float, str]]  # (first round served, version) inside the window
    slots: SpecCounters
    per_domain: dict[str, SpecCounters]
    runs: list[Any]  # training runs, newest first
    probes: list[Bucket] = field(default_factory=list)  # the cost policy's probes (drafter τ)
    # version → (τ of the version it replaced, its own τ) on the same held-out rows at its gate
    gates: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def total(self) -> SpecCounters:
        return sum((b.counters for b in self.buckets), SpecCounters(self.slots.block_size))

    @property
    def probed(self) -> SpecCounters:
        """The window's probes, each counted as the round it stands for (whole-block τ)."""
        return sum((b.counters for b in self.probes), SpecCounters(self.slots.block_size))

    @property
    def busy_tokens_per_s(self) -> float:
        seconds = sum(b.seconds for b in self.buckets)  # only buckets that saw rounds
        return sum(b.tokens for b in self.buckets) / seconds if seconds else 0.0


class Service:
    def __init__(self, cfg: ServeConfig) -> None:
        if cfg.backend == "sglang":
            from app.backends.sglang_checks import require_sglang

            require_sglang()  # refuses with the reason on this machine
        self.cfg = cfg
        self.started_at = time.time()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.target_dir = resolve_target(cfg.target)
        self.model_name = self.target_dir.name
        self.tokenizer = Tokenizer.from_folder(self.target_dir)
        self.vocab_size = TargetConfig.from_folder(self.target_dir).vocab_size
        self.defaults = SamplingDefaults.resolve(
            self.target_dir, cfg.default_temperature, cfg.default_top_p, cfg.default_top_k
        )
        self.db_url = cfg.database_url or f"sqlite:///{data_dir() / 'adaflash.db'}"
        self.db = make_engine(self.db_url)
        migrate(self.db)
        self.registry = Registry(self.db, cfg.weights_dir or data_dir() / "weights")
        # an explicit --drafter none pins plain decoding: no version is followed or trained
        self.pinned_plain = cfg.drafter == "none"
        drafter_dir = resolve_drafter(cfg.drafter, cfg.target)
        version, drafter, served_dir = self._initial_drafter(
            drafter_dir, explicit=bool(cfg.drafter)
        )
        self.sink = QueueSink(maxsize=50_000)
        self.backend: Backend
        if cfg.backend == "sglang":
            if drafter is None or served_dir is None:
                raise ValueError(
                    "the SGLang backend serves a DFlash drafter; --drafter none is not"
                )
            self.backend = self._sglang_backend(drafter, served_dir, version)
        else:
            self.backend = self._embedded_backend(drafter, version)
        self.writer = BufferWriter(self.db, self.sink)
        self.watcher = VersionWatcher(self.backend, self.registry, cfg.dtype)
        self.trainer: subprocess.Popen[bytes] | None = None
        self.swap_log: list[tuple[float, str]] = [(time.time(), version)]
        self.watcher.on_swap = lambda v: self.swap_log.append((time.time(), v))

    def _embedded_backend(self, drafter: DFlashDrafter | None, version: str) -> EngineRunner:
        target = load_target(self.target_dir, self.cfg.dtype)
        eos = tuple(sorted(set(target.cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        engine = Engine(
            target,
            drafter,
            EngineConfig(
                policy=self.cfg.policy if drafter is not None else "ar",
                gamma=self.cfg.gamma,
                suffix=self.cfg.suffix,
                dtype=self.cfg.dtype,
                max_running_requests=self.cfg.max_running_requests,
                max_batch_tokens=max(self.cfg.max_batch_tokens, DEFAULT_BLOCK_SIZE),
                compile=self.cfg.compile,
            ),
            sink=self.sink,
            drafter_version=version,
            detokenize=self.tokenizer.decode,
            eos_token_ids=eos,
        )
        return EngineRunner(engine)

    def _sglang_backend(self, drafter: Any, folder: Path, version: str) -> Backend:
        """SGLang serves the target with ``folder`` as its DFLASH drafter (CUDA hosts)."""
        from app.backends.sglang_engine import (
            EmbeddedSGLang,
            SGLangBackend,
            draft_tensors,
            embedded_sglang_args,
        )

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

    def _initial_drafter(self, folder: str | None, explicit: bool) -> tuple[str, Any, Path | None]:
        """Which drafter serves first. No drafter: plain decoding. A folder given on the command
        line wins over stored state: it becomes the active version (registered first if new).
        The default (shipped) drafter is registered once, and then the registry's active
        version serves, so a server restart keeps what training promoted. A broken active
        version falls back to the folder, and serving still starts.
        Returns (version, drafter, its folder)."""
        if folder is None:
            return "none", None, None
        sha = file_sha256(Path(folder) / "model.safetensors")
        known = {v.sha256: v for v in self.registry.list()}
        if sha not in known:
            vid = "v0000" if not known else self.registry.next_id()
            self.registry.register_folder(Path(folder), vid, note=f"from {folder}")
        else:
            active = self.registry.active()
            if active is None or (explicit and active.id != known[sha].id):
                self.registry.activate(known[sha].id, reason=f"served with --drafter {folder}")
        active = self.registry.active()
        assert active is not None
        try:
            return active.id, self.registry.load(active.id, self.cfg.dtype), active.path
        except VersionError as exc:
            log.error("active version unusable (%s); serving %s instead", exc, folder)
            from adaflash.models.drafter import load_drafter

            return f"file:{Path(folder).name}", load_drafter(folder, self.cfg.dtype), Path(folder)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.backend.start()
        self.writer.start()
        if not self.pinned_plain:
            self.watcher.start()
        if self.cfg.trainer and self.backend.speculative:
            self.trainer = self._spawn_trainer()

    def _spawn_trainer(self) -> subprocess.Popen[bytes]:
        """The trainer process, with this server's training settings (``--settings`` JSON)."""
        settings = {
            "online": self.cfg.online.to_dict(),
            "trainer": asdict(self.cfg.trainer_process),
        }
        fd, path = tempfile.mkstemp(prefix="trainer-settings-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(settings, f)
        self._settings_file = Path(path)
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
            "--settings",
            path,
        ]
        log_path = self.registry.weights_dir.parent / "trainer.log"
        log.info("starting trainer process (log: %s)", log_path)
        with log_path.open("ab") as out:
            return subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def stop(self) -> None:
        """Finish or cancel streams, flush the queue, stop the trainer (in parallel: the trainer
        process gets its signal first, while streams drain)."""
        t0 = time.perf_counter()
        if self.trainer is not None and self.trainer.poll() is None:
            self.trainer.terminate()  # it records a run it was in the middle of as failed
        self.backend.stop(drain_timeout_s=self.cfg.drain_seconds)
        self.watcher.stop()
        if not self.writer.stop(timeout_s=15):
            log.error("could not flush %d buffered records before exit", self.writer.stats.pending)
        if self.trainer is not None:
            try:
                self.trainer.wait(20)
            except subprocess.TimeoutExpired:
                self.trainer.kill()
                self.trainer.wait()
                fail_stale_runs(self.db, "the trainer was killed when the server stopped")
        settings = getattr(self, "_settings_file", None)
        if settings is not None:
            settings.unlink(missing_ok=True)
        self.db.dispose()
        log.warning(
            "stopped in %.1f s: %d trajectories and %d rounds written, %d records dropped",
            time.perf_counter() - t0,
            self.writer.stats.written_trajectories,
            self.writer.stats.written_rounds,
            self.sink.dropped,
        )

    # -- requests ------------------------------------------------------------------------------
    @property
    def max_new_tokens(self) -> int:
        """The per-request ceiling: the operator's flag, else the context window."""
        window = self.backend.max_context
        return min(self.cfg.max_new_tokens or window, window)

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
        """SamplingParams from API fields: what a request leaves out comes from
        ``self.defaults``; the server's limits apply. ValueError says why a request cannot run."""
        t = self.defaults.temperature if temperature is None else temperature
        if t > self.cfg.max_temperature:
            raise ValueError(
                f"temperature {t} is above this server's limit {self.cfg.max_temperature}"
            )
        window = self.backend.max_context
        room = window - prompt_len
        if room < 1:
            raise ValueError(
                f"the prompt ({prompt_len} tokens) fills the context window of {window} tokens"
            )
        n = max_new_tokens if max_new_tokens is not None else min(room, self.max_new_tokens)
        if n > self.max_new_tokens:
            raise ValueError(f"max tokens {n} is above this server's limit {self.max_new_tokens}")
        if n > room:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max tokens ({n}) exceeds the "
                f"context window of {window} tokens"
            )
        vocab = self.vocab_size
        bad = [t for t in stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:3]} are outside the vocabulary (0…{vocab - 1})")
        return SamplingParams(
            temperature=t,
            top_p=self.defaults.top_p if top_p is None else top_p,
            top_k=self.defaults.top_k if top_k is None else top_k,
            max_new_tokens=n,
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            seed=seed,
        )

    def model_info(self) -> dict[str, Any]:
        """What this server serves, with the request defaults it applies."""
        return {
            "model_path": self.target_dir.name,
            "served_model_name": self.model_name,
            "max_context_length": self.backend.max_context,
            "max_new_tokens": self.max_new_tokens,
            "max_temperature": self.cfg.max_temperature,
            "default_sampling": {
                "temperature": self.defaults.temperature,
                "top_p": self.defaults.top_p,
                "top_k": self.defaults.top_k,
                "source": self.defaults.source,
            },
            "speculative_algorithm": "ADAFLASH" if self.backend.speculative else None,
            "speculative_num_draft_tokens": self.backend.block_size,
            "drafter_version": self.backend.version,
            "policy": self.backend.policy,
            "backend": self.cfg.backend,
        }

    # -- admin actions (the API and the UI call these) ----------------------------------------
    def trainer_alive(self) -> bool:
        return self.trainer is not None and self.trainer.poll() is None

    def request_training(self) -> tuple[int, str | None]:
        """Queue a training run; returns its id and a note when no trainer will pick it up."""
        run_id = request_run(self.db, "admin")
        note = (
            None
            if self.trainer_alive()
            else "no trainer process is attached to this server; start `adaflash trainer` "
            "with the same database URL to run the request"
        )
        return run_id, note

    def versions(self) -> list[Version]:
        return self.registry.list()

    def active_version(self) -> Version | None:
        return self.registry.active()

    def runs(self, limit: int = 50) -> list[Any]:
        return list_runs(self.db, limit)

    def promote(self, version: str, reason: str | None = None) -> Version:
        """Make ``version`` active and swap it in now; VersionError says why not."""
        self._refuse_when_pinned()
        v = self.registry.activate(version, reason=reason)
        self.watcher.check()
        return v

    def rollback(self, version: str | None = None) -> Version:
        self._refuse_when_pinned()
        v = self.registry.rollback(version)
        self.watcher.check()
        return v

    def configure(self, policy: str | None = None, gamma: float | None = None) -> None:
        """Change the verify-length policy and γ from the next step; ValueError says why not."""
        self.backend.set_policy(policy, gamma)

    def _refuse_when_pinned(self) -> None:
        if self.pinned_plain:
            raise VersionError(
                "this server runs with --drafter none (plain decoding); restart it with a "
                "drafter to serve versions"
            )

    # -- dashboard -----------------------------------------------------------------------------
    def dashboard(self, window_s: float, now: float | None = None) -> Dashboard:
        now = now or time.time()
        block = self.backend.block_size
        bucket_s = max(5, int(window_s) // 40)
        starts = stats.version_starts(self.db, window_s, now=now)
        served = {name for _, name in starts}
        return Dashboard(
            window_s,
            now,
            stats.timeline(self.db, window_s, bucket_s=bucket_s, now=now),
            starts,
            stats.slot_acceptance(self.db, window_s, block, now=now),
            stats.by_domain(self.db, window_s, now=now),
            list_runs(self.db, 20),
            probe_buckets(self.backend.probes(now - window_s), block, bucket_s),
            {v.id: g for v in self.versions() if v.id in served and (g := v.gate_tau)},
        )

    def remove_data(self) -> None:  # used by tests that build throwaway services
        shutil.rmtree(self.registry.weights_dir, ignore_errors=True)
